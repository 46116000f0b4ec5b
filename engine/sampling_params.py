"""Per-request sampling parameters, validated when a request enters the engine."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.errors import InvalidRequestError
from engine.structured.params import StructuredOutputsParams

_GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) disables top-k
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token, besides the sampled one
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None  # guided decoding: see engine/structured

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def validate(self) -> None:
        _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise InvalidRequestError("temperature", f"must be >= 0, got {self.temperature}")
        _check_number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, minimum=-1)
        _check_number("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise InvalidRequestError("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=0)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, minimum=0)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequestError("stop", f"stop strings must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, minimum=0)
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise InvalidRequestError("structured_outputs", "must be StructuredOutputsParams, got "
                                                                f"{type(self.structured_outputs).__name__}")
            self.structured_outputs.validate()


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(name, f"must be an integer, got {value!r}")
    if value < minimum:
        raise InvalidRequestError(name, f"must be >= {minimum}, got {value}")


def _check_number(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise InvalidRequestError(name, f"must be a number, got {value!r}")
