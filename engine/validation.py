"""Checks on a request before it enters the engine; each failure names its field."""
from __future__ import annotations

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams

MAX_LOGPROBS = 20


def validate_request(req_id: str, prompt_token_ids, params: SamplingParams, max_model_len: int,
                     vocab_size: int, active_req_ids) -> None:
    if not isinstance(req_id, str) or not req_id:
        raise InvalidRequestError("request_id", "must be a non-empty string")
    if req_id in active_req_ids:
        raise InvalidRequestError("request_id", f"{req_id!r} is already in the engine")
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError("sampling_params", f"must be SamplingParams, got {type(params).__name__}")
    params.validate()
    _validate_prompt(prompt_token_ids, max_model_len, vocab_size)
    if params.logprobs is not None and params.logprobs > MAX_LOGPROBS:
        raise InvalidRequestError("logprobs", f"at most {MAX_LOGPROBS}, got {params.logprobs}")
    bad_stop = [t for t in params.stop_token_ids if t >= vocab_size]
    if bad_stop:
        raise InvalidRequestError("stop_token_ids", f"{bad_stop} outside the vocabulary of {vocab_size}")


def _validate_prompt(token_ids, max_model_len: int, vocab_size: int) -> None:
    if not isinstance(token_ids, (list, tuple)) or not token_ids:
        raise InvalidRequestError("prompt", "is empty")
    if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size for t in token_ids):
        raise InvalidRequestError("prompt_token_ids", f"every id must be an integer in [0, {vocab_size})")
    if len(token_ids) >= max_model_len:
        raise InvalidRequestError("prompt", f"has {len(token_ids)} tokens; the context (max_model_len) is "
                                            f"{max_model_len}, leaving no room to generate")
