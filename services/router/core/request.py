"""Turning a `GenerateInput` into a `RoutedRequest`: validated, tokenized, classified.

Both fronts build one `GenerateInput` per request, each from its own form (the gRPC
servicer from its GenerateRequest, the HTTP API from its pydantic body), and hand it to
the same `RequestValidator`. Every check names its field (InvalidRequestError.field), the
same names the engine uses, so a bad request fails at the router with the message a worker
would have given, before it costs a worker anything.

Caps (both fronts): every value a client sends is bounded before it costs anything, cheap
checks first (a 10 KB slo_class is refused by its length, before the class lookup; a text
prompt far longer than the context could ever hold, before it is tokenized), and an error
message never echoes more than a short prefix of what the client sent.

Request ids: the router names every request itself (uuid4 hex); a client's own id is kept
only to label its responses, so two clients choosing the same id never meet on a worker
(where the id names the request's KV blocks, lease and aborts).
"""
from __future__ import annotations

import math
import struct
import uuid
from dataclasses import dataclass

from pdserve.engine import InvalidRequestError, SamplingParams
from pdserve.engine.core.block_hash import MAX_CACHE_SALT_CHARS
from pdserve.engine.structured.params import DEFAULT_COMPILE_TIMEOUT_S
from pdserve.engine.validation import MAX_LOGPROBS, validate_token_ids
from pdserve.engine.slo import SLOTargets
from pdserve.services.common.convert import sampling_to_proto, slo_to_proto
from pdserve.services.pb import common_pb2
from pdserve.services.router.config import SLOClass
from pdserve.services.router.core.grammar_check import GrammarCheck
from pdserve.services.router.core.model_info import ModelInfo

_INT32_LIMIT = 1 << 31
_INT64_MAX = (1 << 63) - 1  # the workers' wire carries seeds as int64
# the sampling fields the hop to the workers carries as int32 (common.proto)
_INT32_FIELDS = ("max_tokens", "top_k", "logprobs", "min_tokens", "prompt_logprobs")

MAX_STOP_STRINGS = 16        # OpenAI allows 4; each is matched against the text after every step
MAX_STOP_CHARS = 256         # per stop string
MAX_STOP_TOKEN_IDS = 256
MAX_BAD_WORDS = 128          # vLLM's bound too; each is matched against the output's tail every step
MAX_BAD_WORD_CHARS = 256
MAX_NAME_CHARS = 256         # model and the client's req_id
MAX_SLO_CLASS_CHARS = 64
# A text prompt longer than this many characters per context token cannot fit (no tokenizer's
# tokens are that long on average): refused before tokenizing, which would cost seconds.
MAX_PROMPT_CHARS_PER_TOKEN = 64
# A prompt sent with truncate_prompt_tokens may be longer than the context (that is why it is
# truncated): it may have this many times the characters before it is refused untokenized.
TRUNCATED_PROMPT_CONTEXTS = 4
_SHOWN_CHARS = 40            # of a client's value quoted back in an error


@dataclass(frozen=True)
class GenerateInput:
    """One request as a front received it, before validation."""
    prompt: str | tuple[int, ...]  # text, or token ids; "" or (): none given
    sampling: SamplingParams       # already checked by the engine's own rules
    req_id: str = ""               # the client's own id: labels its responses only (see above)
    slo_class: str = ""            # "": the router's default class
    model: str = ""                # "": the served model
    cache_salt: str = ""           # shares cached KV only with requests of the same salt ("": none)
    # vLLM's truncate_prompt_tokens: keep the prompt's last k tokens (-1: as many as the
    # context leaves beside max_tokens, at least one); None keeps it whole
    truncate_prompt_tokens: int | None = None
    # the tokens a client already received of a stream that broke: the answer continues after them
    resume_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class RoutedRequest:
    req_id: str                    # the router's own (uuid4 hex): what the workers know it by
    prompt_token_ids: tuple[int, ...]
    sampling: common_pb2.SamplingParams  # as the workers receive it, built once here
    slo_class: str
    slo: SLOClass
    # chosen by the flow from the pools' state when the request starts (decide/paths.py)
    path: str = ""                 # policy.DIRECT or policy.DISAGGREGATED
    prefill_chunk_tokens: int = 0  # the direct path: chunk cap for the decode worker (0: its own)
    decode_address: str = ""       # the disaggregated path: the decode worker assumed, kept free of its prefill
    client_req_id: str = ""        # the client's id, if it sent one: its responses carry it
    cache_salt: str = ""           # to the workers as is: it enters the first block hash
    # SamplingParams.n: completions of the prompt, prefilled once (core/choices.py); a
    # completion as a request of its own has n 1 and its index among them
    n: int = 1
    index: int = 0
    # a resumed stream (GenerateRequest.resume_token_ids): the tokens the client has; a decode
    # worker computes the prompt and them, and streams what follows
    resumed_token_ids: tuple[int, ...] = ()

    def prefill_slo(self, min_class_ttft_ms: float, waited_s: float) -> common_pb2.SLOTargets:
        """A prefill worker's targets: its class's TTFT target less `waited_s` spent here
        (queued, a failed attempt), and the tightest TTFT target of the router's classes."""
        return slo_to_proto(SLOTargets(self.slo.ttft_ms / 1000, min_class_ttft_ms / 1000).spent(waited_s))

    def decode_slo(self) -> common_pb2.SLOTargets:
        """A decode worker's: the ITL target its stream keeps."""
        return slo_to_proto(SLOTargets(itl_target_s=self.slo.itl_ms / 1000))


class RequestValidator:
    def __init__(self, model: ModelInfo, tokenizer, slo_classes: dict[str, SLOClass], default_slo_class: str,
                 grammar_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S):
        self.model = model
        self.tokenizer = tokenizer
        self.slo_classes = slo_classes
        self.default_slo_class = default_slo_class
        # structured outputs: a spec that does not compile is refused here (grammar_check.py)
        self.grammars = GrammarCheck(tokenizer, model.vocab_size or None, grammar_timeout_s)

    def validate(self, inp: GenerateInput) -> RoutedRequest:
        """Raises InvalidRequestError naming the bad field."""
        self._check_names(inp)
        _check_text("cache_salt", inp.cache_salt, MAX_CACHE_SALT_CHARS)
        slo_class = inp.slo_class or self.default_slo_class
        _check_text("slo_class", slo_class, MAX_SLO_CLASS_CHARS)
        if slo_class not in self.slo_classes:
            raise InvalidRequestError("slo_class", f"unknown class {shown(slo_class)}; "
                                                   f"known: {sorted(self.slo_classes)}")
        self._check_sampling(inp.sampling)
        sampling = _to_wire(inp.sampling)
        prompt = self._prompt(inp.prompt, inp.truncate_prompt_tokens, inp.sampling.max_tokens)
        self._check_resume(inp, prompt)
        if inp.sampling.structured_outputs is not None:  # last: the costliest check (a compile)
            self.grammars.check(inp.sampling.structured_outputs)
        return RoutedRequest(uuid.uuid4().hex, prompt, sampling, slo_class, self.slo_classes[slo_class],
                             client_req_id=inp.req_id, cache_salt=inp.cache_salt, n=inp.sampling.n,
                             resumed_token_ids=tuple(inp.resume_token_ids))

    def _check_resume(self, inp: GenerateInput, prompt: tuple[int, ...]) -> None:
        resume = inp.resume_token_ids
        if not resume:
            return
        if inp.sampling.n != 1:
            raise InvalidRequestError("resume_token_ids", f"resume one completion at a time (n 1), got n "
                                                          f"{inp.sampling.n}")
        if len(resume) >= inp.sampling.max_tokens:
            raise InvalidRequestError("resume_token_ids", f"holds {len(resume)} tokens, max_tokens is "
                                                          f"{inp.sampling.max_tokens}: the stream was complete")
        vocab = self.model.vocab_size or _INT32_LIMIT
        if any(not 0 <= t < vocab for t in resume):
            raise InvalidRequestError("resume_token_ids", f"every id must be an integer in [0, {vocab})")
        if len(prompt) + len(resume) >= self.model.max_model_len:
            raise InvalidRequestError("resume_token_ids", f"the prompt's {len(prompt)} tokens and these "
                                                          f"{len(resume)} fill the context "
                                                          f"({self.model.max_model_len}): nothing could follow")

    def _check_names(self, inp: GenerateInput) -> None:
        _check_text("req_id", inp.req_id, MAX_NAME_CHARS)
        _check_text("model", inp.model, MAX_NAME_CHARS)
        if inp.model and not self.model.serves(inp.model):
            raise InvalidRequestError("model", f"{shown(inp.model)} is not served here "
                                               f"(serving {self.model.served_name!r})")

    def _check_sampling(self, params: SamplingParams) -> None:
        """Bounds the engine does not set: what one request may ask of a worker."""
        limit = self.model.max_model_len
        if params.max_tokens > limit:  # the context bounds what any request can generate
            raise InvalidRequestError("max_tokens", f"must be at most the context (max_model_len) {limit}, "
                                                    f"got {params.max_tokens}")
        if params.logprobs is not None and params.logprobs > MAX_LOGPROBS:
            raise InvalidRequestError("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {params.logprobs}")
        if params.prompt_logprobs is not None and params.prompt_logprobs > MAX_LOGPROBS:
            raise InvalidRequestError("prompt_logprobs", f"must be in [0, {MAX_LOGPROBS}], "
                                                         f"got {params.prompt_logprobs}")
        if params.seed is not None and params.seed + params.n - 1 > _INT64_MAX:  # completion i: seed + i
            raise InvalidRequestError("seed", f"must be at most 2^63 - n ({_INT64_MAX - params.n + 1}) with "
                                              f"n {params.n}, got {params.seed}")
        if len(params.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(params.stop)}")
        for stop in params.stop:
            _check_text("stop", stop, MAX_STOP_CHARS)
        if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids, "
                                                        f"got {len(params.stop_token_ids)}")
        self._check_logits_fields(params)

    def _check_logits_fields(self, params: SamplingParams) -> None:
        """Bounds on bad_words, allowed_token_ids and logit_bias (one step's work per request),
        and every token id they name in the vocabulary, as the engine checks."""
        if len(params.bad_words) > MAX_BAD_WORDS:
            raise InvalidRequestError("bad_words", f"at most {MAX_BAD_WORDS} words, got {len(params.bad_words)}")
        for word in params.bad_words:
            _check_text("bad_words", word, MAX_BAD_WORD_CHARS)
        vocab = self.model.vocab_size
        for name in ("allowed_token_ids", "logit_bias"):
            if vocab and len(getattr(params, name) or ()) > vocab:
                raise InvalidRequestError(name, f"at most {vocab} entries (the vocabulary), "
                                                f"got {len(getattr(params, name))}")
        if vocab:
            validate_token_ids(params, vocab)

    def _prompt(self, prompt: str | tuple[int, ...], truncate: int | None = None,
                max_tokens: int = 1) -> tuple[int, ...]:
        limit = self.model.max_model_len
        if truncate is not None and not (truncate == -1 or 1 <= truncate <= limit):
            raise InvalidRequestError("truncate_prompt_tokens", f"must be -1 (what the context leaves beside "
                                                                f"max_tokens) or in [1, {limit}] (max_model_len), "
                                                                f"got {truncate}")
        if truncate == -1:  # the prompt's end that leaves max_tokens room (at least 1): kept whole when it fits
            truncate = limit - min(max(max_tokens, 1), limit - 1)
        if isinstance(prompt, str):
            contexts = 1 if truncate is None else TRUNCATED_PROMPT_CONTEXTS
            _check_text("prompt", prompt, MAX_PROMPT_CHARS_PER_TOKEN * limit * contexts)
            token_ids = tuple(self.tokenizer.encode(prompt)) if prompt else ()
        else:
            token_ids = tuple(prompt)
        if truncate is not None:  # vLLM's side: the last k tokens
            token_ids = token_ids[-truncate:]
        if not token_ids:
            raise InvalidRequestError("prompt", "is empty")
        vocab = self.model.vocab_size or _INT32_LIMIT  # unknown: at least what the workers' wire carries
        if any(not 0 <= t < vocab for t in token_ids):
            raise InvalidRequestError("prompt_token_ids", f"every id must be an integer in [0, {vocab})")
        if len(token_ids) >= limit:  # as the engine: at least one position must remain to generate
            raise InvalidRequestError("prompt", f"has {len(token_ids)} tokens; the context (max_model_len) is "
                                                f"{limit}, leaving no room to generate")
        return token_ids


def _to_wire(params: SamplingParams) -> common_pb2.SamplingParams:
    """The engine accepts any int, the hop to the workers only int32: refuse what it cannot
    carry here, naming the field (protobuf's own error names none). Only HTTP clients can
    send such values; a gRPC client's own wire is int32 already."""
    values = {name: [getattr(params, name)] for name in _INT32_FIELDS if getattr(params, name) is not None}
    values["stop_token_ids"] = params.stop_token_ids
    values["allowed_token_ids"] = params.allowed_token_ids or []
    values["logit_bias"] = list(params.logit_bias or ())
    for name, field_values in values.items():
        if any(not -_INT32_LIMIT <= v < _INT32_LIMIT for v in field_values):
            raise InvalidRequestError(name, "a value is out of range")
    if not _as_float32(params.repetition_penalty) > 0 or math.isinf(_as_float32(params.repetition_penalty)):
        raise InvalidRequestError("repetition_penalty", "is out of range of the workers' float32")
    return sampling_to_proto(params)


def _as_float32(value: float) -> float:
    """`value` as the hop to the workers carries it (protobuf float)."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.inf


def shown(value: str) -> str:
    """A client's value as an error quotes it: a short prefix (a long one would make the
    error itself too big, e.g. for gRPC's trailing metadata), surrogates escaped by repr."""
    return repr(value[:_SHOWN_CHARS]) + ("..." if len(value) > _SHOWN_CHARS else "")


def _check_text(field: str, value: str, max_chars: int) -> None:
    if len(value) > max_chars:
        raise InvalidRequestError(field, f"has {len(value)} characters, at most {max_chars} are allowed")
    if has_lone_surrogate(value):
        raise InvalidRequestError(field, "holds a lone UTF-16 surrogate (e.g. \\ud800), which is not text")


def has_lone_surrogate(text: str) -> bool:
    """JSON may escape half of a UTF-16 pair on its own; Python decodes it into a str that
    no UTF-8 encoder (tokenizer, protobuf, the response) accepts."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False
