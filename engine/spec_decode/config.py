"""`speculative_config`, with vLLM's names: {"method": "ngram", "num_speculative_tokens": k,
"prompt_lookup_min": a, "prompt_lookup_max": b} or {"method": "draft_model", "model":
<path or alias>, "num_speculative_tokens": k}; both take "disable_by_batch_size"."""
from __future__ import annotations

from dataclasses import dataclass, fields

from pdserve.engine.errors import InvalidRequestError

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1   # ngram: the shortest suffix to look up in the request's tokens
    prompt_lookup_max: int = 4   # ngram: the longest (tried first)
    model: str | None = None     # draft_model: the draft's path or alias (same tokenizer as the target)
    # Speculation turns itself off for a step with more running requests than this: a big
    # batch is compute-bound, and verifying drafts then costs more than it saves. 0: never.
    disable_by_batch_size: int = 0

    def __post_init__(self) -> None:
        field = "speculative_config"
        if self.method not in METHODS:
            raise InvalidRequestError(f"{field}.method", f"must be one of {list(METHODS)}, got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidRequestError(f"{field}.{name}", f"must be an integer >= 0, got {value!r}")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise InvalidRequestError(f"{field}.num_speculative_tokens",
                                      f"must be in [1, {MAX_SPECULATIVE_TOKENS}], got {self.num_speculative_tokens}")
        if self.method == "ngram":
            if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
                raise InvalidRequestError(f"{field}.prompt_lookup_min", "must satisfy 1 <= prompt_lookup_min <= "
                                          f"prompt_lookup_max, got {self.prompt_lookup_min} and {self.prompt_lookup_max}")
            if self.model is not None:
                raise InvalidRequestError(f"{field}.model", "is for method 'draft_model' only")
        elif not isinstance(self.model, str) or not self.model:
            raise InvalidRequestError(f"{field}.model", "a draft model (path or alias) is required by 'draft_model'")

    @classmethod
    def from_dict(cls, value: dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From the dict users pass (LLM(speculative_config=...), --speculative-config JSON)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise InvalidRequestError("speculative_config", f"must be a dict, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise InvalidRequestError(f"speculative_config.{unknown[0]}", f"is not a known key; known: {sorted(known)}")
        if "method" not in value or "num_speculative_tokens" not in value:
            missing = "method" if "method" not in value else "num_speculative_tokens"
            raise InvalidRequestError(f"speculative_config.{missing}", "is required")
        return cls(**value)
