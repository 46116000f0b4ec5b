"""Per-request sampling parameters, validated when a request enters the engine."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.structured.params import StructuredOutputsParams

_GREEDY_EPS = 1e-5
# SamplingParams.n: completions per prompt, each its own request in the engine and on the
# workers (engine/parallel_sampling.py); vLLM sets no bound, one request may not ask more
MAX_N = 128


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
    # top-N logprobs per prompt token (vLLM's): each prompt token's own, given the tokens before it,
    # besides the N most likely there; the first token has none. The request then takes no prefix hits.
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True  # special tokens (EOS, control tokens) are left out of the text
    structured_outputs: StructuredOutputsParams | None = None  # guided decoding: see engine/structured
    # On the raw logits, before temperature, as vLLM (engine/sample/logits_processors.py):
    repetition_penalty: float = 1.0   # > 0: prompt and output tokens' logits / p if > 0, else * p
    presence_penalty: float = 0.0     # [-2, 2]: minus p once for every token the output holds
    frequency_penalty: float = 0.0    # [-2, 2]: minus p times each token's count in the output
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    min_tokens: int = 0               # EOS and stop_token_ids masked until this many output tokens
    bad_words: list[str] = field(default_factory=list)  # never completed by the output (resolve_bad_words)
    allowed_token_ids: list[int] | None = None  # every other token masked
    # completions of the prompt (vLLM's parallel sampling; engine/parallel_sampling.py): the
    # prompt is computed once and shared; completion i of a seeded request uses seed + i
    n: int = 1
    # bad_words as token sequences: set by resolve_bad_words (EngineCore.add_request), which has the tokenizer
    bad_words_token_ids: list[list[int]] = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.bad_words = [self.bad_words] if isinstance(self.bad_words, str) else list(self.bad_words or [])
        if self.allowed_token_ids is not None and not isinstance(self.allowed_token_ids, (str, bytes)):
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def processes_logits(self) -> bool:
        """Whether any field changes this request's logits before temperature: a batch
        without one skips engine/sample/logits_processors.py entirely."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0 or self.frequency_penalty != 0
                or bool(self.logit_bias) or self.min_tokens > 0 or bool(self.bad_words_token_ids)
                or self.allowed_token_ids is not None)

    def validate(self) -> None:
        _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_int("n", self.n, minimum=1)
        if self.n > MAX_N:
            raise InvalidRequestError("n", f"must be at most {MAX_N}, got {self.n}")
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
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, minimum=0)
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
        self._validate_logits_fields()

    def _validate_logits_fields(self) -> None:
        """The fields of engine/sample/logits_processors.py; token ids against the vocabulary
        are checked where it is known (engine.validation.validate_token_ids)."""
        _check_number("repetition_penalty", self.repetition_penalty)
        if not 0 < self.repetition_penalty < float("inf"):
            raise InvalidRequestError("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            _check_number(name, getattr(self, name))
            if not -2 <= getattr(self, name) <= 2:
                raise InvalidRequestError(name, f"must be in [-2, 2], got {getattr(self, name)}")
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError("min_tokens", f"must be at most max_tokens ({self.max_tokens}), "
                                                    f"got {self.min_tokens}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise InvalidRequestError("logit_bias", f"must map token ids to biases, got {self.logit_bias!r}")
            for token_id, bias in self.logit_bias.items():
                _check_int("logit_bias", token_id, minimum=0)
                _check_number("logit_bias", bias)
                if not -100 <= bias <= 100:
                    raise InvalidRequestError("logit_bias", f"biases must be in [-100, 100], got {bias}")
        for word in self.bad_words:
            if not isinstance(word, str) or not word.strip():
                raise InvalidRequestError("bad_words", f"must be strings with a non-space character, got {word!r}")
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids:
                raise InvalidRequestError("allowed_token_ids", "must be a non-empty list of token ids")
            for t in self.allowed_token_ids:
                _check_int("allowed_token_ids", t, minimum=0)


def resolve_bad_words(params: SamplingParams, tokenizer) -> SamplingParams:
    """`params` with bad_words_token_ids set from bad_words (a copy; the same object when
    there are none). As vLLM: each word, stripped of leading space, encoded without special
    tokens; and once more after a space (the word inside a text) when that gives another
    first token and as many tokens."""
    if not params.bad_words:
        return params
    sequences: list[list[int]] = []
    for word in params.bad_words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if bare:
            sequences.append(bare)
        if bare and spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            sequences.append(spaced)
    resolved = copy.copy(params)
    resolved.bad_words_token_ids = sequences
    return resolved


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(name, f"must be an integer, got {value!r}")
    if value < minimum:
        raise InvalidRequestError(name, f"must be >= {minimum}, got {value}")


def _check_number(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise InvalidRequestError(name, f"must be a number, got {value!r}")
