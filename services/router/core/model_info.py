"""What the router needs to know about the served model, without loading its weights:
its context length and vocabulary size (to validate prompts and answer ListModels) and
its tokenizer (to turn text prompts into token ids)."""
from __future__ import annotations

from dataclasses import dataclass

import engine
from engine import load_tokenizer


@dataclass(frozen=True)
class ModelInfo:
    name: str            # as configured (--model): an alias or a path
    model_id: str        # the resolved id (the name clients may also send)
    max_model_len: int
    vocab_size: int


def describe_model(model: str, max_model_len: int | None = None) -> ModelInfo:
    """Reads config.json or the GGUF header. `max_model_len` may lower the model's context."""
    described = engine.describe_model(model)
    context = described.max_position_embeddings
    if max_model_len is not None and max_model_len > context:
        raise ValueError(f"max_model_len: {max_model_len} exceeds the model's context of {context} tokens")
    return ModelInfo(model, described.model_id, max_model_len or context, described.vocab_size)


def tokenizer_for(model: str):
    return load_tokenizer(model)
