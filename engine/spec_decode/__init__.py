"""Speculative decoding: a cheap proposer guesses tokens, the target model scores them all
in one forward pass, and the accepted prefix is kept (see proposer.py and rejection.py)."""
from pdserve.engine.spec_decode.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
