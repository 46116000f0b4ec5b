"""Checks on a request before it enters the engine; each failure names its field."""
from __future__ import annotations

import copy
import dataclasses
from typing import TYPE_CHECKING

from pdserve.engine.core.block_hash import check_cache_salt
from pdserve.engine.engine_request import EngineRequest
from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.parallel_sampling import validate_fork
from pdserve.engine.request import RequestMode
from pdserve.engine.sampling_params import SamplingParams, resolve_bad_words

if TYPE_CHECKING:  # info.py imports validate_request from here
    from pdserve.engine.info import EngineInfo

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


def check_engine_request(new: EngineRequest, info: EngineInfo, tokenizer, active_req_ids) -> EngineRequest:
    """Every check of EngineCore.add_request; a bad request raises InvalidRequestError naming
    its field. Returns the request as the engine runs it: bad words resolved into token ids
    with the tokenizer (each engine has its own), and the prompt-logprobs rule applied."""
    validate_request(new.req_id, new.prompt_token_ids, new.params, info.max_model_len, info.vocab_size,
                     active_req_ids)
    params = resolve_bad_words(new.params, tokenizer)
    validate_token_ids(params, info.vocab_size)
    validate_mode(new.mode, new.output_token_ids)
    validate_transfer(new.prompt_token_ids, new.output_token_ids, new.kv_import, info.kv_block_shape,
                      info.vocab_size)
    if new.prefill_chunk_tokens < 0:
        raise InvalidRequestError("prefill_chunk_tokens", f"must be >= 0 (0: no cap), got {new.prefill_chunk_tokens}")
    new.slo.validate()
    if (problem := check_cache_salt(new.cache_salt)) is not None:
        raise InvalidRequestError("cache_salt", problem)
    params, kv_import = prompt_logprobs_rule(params, new.mode, new.kv_import)
    validate_fork(new.req_id, params, new.mode, len(new.output_token_ids), active_req_ids)
    return dataclasses.replace(new, params=params, kv_import=kv_import)


def prompt_logprobs_rule(params: SamplingParams, mode: RequestMode, kv_import):
    """The engine that computes a prompt computes its logprobs. A decode-only request
    continues a prompt computed elsewhere (its prefill worker sent them): it computes none
    and may read what KV it is given. Any other request with prompt_logprobs computes every
    prompt token: an imported prefix would, like a prefix hit, leave its tokens without any."""
    if params.prompt_logprobs is None:
        return params, kv_import
    if mode != RequestMode.DECODE_ONLY:
        return params, None
    params = copy.copy(params)
    params.prompt_logprobs = None
    return params, kv_import
