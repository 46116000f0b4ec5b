"""What the router needs to know about the served model, without loading its weights:
its context length and vocabulary size (to validate prompts and answer ListModels) and
its tokenizer (to turn text prompts into token ids)."""
from __future__ import annotations

from dataclasses import dataclass

from pdserve import engine
from pdserve.engine import load_tokenizer


@dataclass(frozen=True)
class ModelInfo:
    name: str            # as configured (--model): an alias, a path or org/name
    model_id: str        # the resolved id (the name clients may also send)
    max_model_len: int
    vocab_size: int
    # --served-model-name: the only names clients may send, the first the one reported;
    # empty: `name` (reported) and `model_id`
    served_model_names: tuple[str, ...] = ()

    @property
    def served_name(self) -> str:
        """The name /v1/models, ListModels and every response report."""
        return self.served_model_names[0] if self.served_model_names else self.name

    @property
    def accepted_names(self) -> tuple[str, ...]:
        return self.served_model_names or (self.name, self.model_id)

    def serves(self, model: str) -> bool:
        """Whether a request's `model` names this model."""
        return model in self.accepted_names


def describe_model(model: str, max_model_len: int | None = None, revision: str | None = None,
                   served_model_names: tuple[str, ...] = ()) -> ModelInfo:
    """Reads config.json or the GGUF header. `max_model_len` may lower the model's context."""
    described = engine.describe_model(model, revision)
    context = described.max_position_embeddings
    if max_model_len is not None and max_model_len > context:
        raise ValueError(f"max_model_len: {max_model_len} exceeds the model's context of {context} tokens")
    return ModelInfo(model, described.model_id, max_model_len or context, described.vocab_size,
                     tuple(served_model_names))


def tokenizer_for(model: str, revision: str | None = None):
    return load_tokenizer(model, revision)
