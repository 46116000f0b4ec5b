"""Structured outputs (guided decoding): a grammar compiled once per spec, a matcher per
request, and each step a token bitmask over the batch's logits (see grammar.py)."""
from pdserve.engine.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
