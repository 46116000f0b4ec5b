"""Checks on a request before it enters the engine; each failure names its field."""
from __future__ import annotations

from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.request import RequestMode
from pdserve.engine.sampling_params import SamplingParams

MAX_LOGPROBS = 20


def validate_request(req_id: str, prompt_token_ids, params: SamplingParams, max_model_len: int,
                     vocab_size: int, active_req_ids) -> None:
    if not isinstance(req_id, str) or not req_id:
        raise InvalidRequestError("req_id", "must be a non-empty string")
    if req_id in active_req_ids:
        raise InvalidRequestError("req_id", f"{req_id!r} is already in the engine")
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError("sampling_params", f"must be SamplingParams, got {type(params).__name__}")
    params.validate()
    _validate_prompt(prompt_token_ids, max_model_len, vocab_size)
    if params.logprobs is not None and params.logprobs > MAX_LOGPROBS:
        raise InvalidRequestError("logprobs", f"at most {MAX_LOGPROBS}, got {params.logprobs}")
    if params.prompt_logprobs is not None and params.prompt_logprobs > MAX_LOGPROBS:
        raise InvalidRequestError("prompt_logprobs", f"at most {MAX_LOGPROBS}, got {params.prompt_logprobs}")
    validate_token_ids(params, vocab_size)


def validate_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """Every token id a request's sampling fields name is in the vocabulary (the router
    checks the same, knowing the vocabulary size)."""
    named = {"stop_token_ids": params.stop_token_ids, "logit_bias": list(params.logit_bias or ()),
             "allowed_token_ids": params.allowed_token_ids or (),
             "bad_words": [t for ids in params.bad_words_token_ids for t in ids]}
    for name, token_ids in named.items():
        outside = sorted({t for t in token_ids if t >= vocab_size})
        if outside:
            shown = outside[:8] + (["..."] if len(outside) > 8 else [])
            raise InvalidRequestError(name, f"{shown} outside the vocabulary of {vocab_size}")


def _validate_prompt(token_ids, max_model_len: int, vocab_size: int) -> None:
    if not isinstance(token_ids, (list, tuple)) or not token_ids:
        raise InvalidRequestError("prompt", "is empty")
    if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size for t in token_ids):
        raise InvalidRequestError("prompt_token_ids", f"every id must be an integer in [0, {vocab_size})")
    if len(token_ids) >= max_model_len:
        raise InvalidRequestError("prompt", f"has {len(token_ids)} tokens; the context (max_model_len) is "
                                            f"{max_model_len}, leaving no room to generate")


def validate_mode(mode, output_token_ids) -> None:
    """Only a decode-only request continues tokens emitted elsewhere, and it always does."""
    if not isinstance(mode, RequestMode):
        raise InvalidRequestError("mode", f"must be a RequestMode, got {mode!r}")
    if mode == RequestMode.DECODE_ONLY and not output_token_ids:
        raise InvalidRequestError("output_token_ids", "a decode_only request continues at least one token")
    if mode != RequestMode.DECODE_ONLY and output_token_ids:
        raise InvalidRequestError("output_token_ids", f"only a decode_only request continues tokens; "
                                                      f"this one is {mode.value}")


def validate_transfer(prompt_token_ids, output_token_ids, kv_import, block_shape: tuple[int, ...],
                      vocab_size: int) -> None:
    """Checks on the disaggregation inputs of a request (see EngineCore.add_request)."""
    if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size for t in output_token_ids):
        raise InvalidRequestError("output_token_ids", f"every id must be an integer in [0, {vocab_size})")
    if kv_import is None:
        return
    num_tokens = len(prompt_token_ids) + len(output_token_ids)
    if not 0 < kv_import.num_tokens < num_tokens:
        raise InvalidRequestError("kv_import", f"covers {kv_import.num_tokens} tokens; it must cover "
                                               f"between 1 and {num_tokens - 1} of the request's {num_tokens}")
    block_size = block_shape[2]
    num_blocks = -(-kv_import.num_tokens // block_size)
    if not 0 <= kv_import.first_block < num_blocks:
        raise InvalidRequestError("kv_import", f"first_block {kv_import.first_block}: it must be in [0, {num_blocks})")
    num_blocks -= kv_import.first_block
    if tuple(kv_import.blocks.shape) != (num_blocks, *block_shape):
        raise InvalidRequestError("kv_import", f"blocks have shape {tuple(kv_import.blocks.shape)}, "
                                               f"expected {(num_blocks, *block_shape)}")
