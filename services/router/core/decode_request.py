"""The one place the router builds a DecodeRequest: three starts, one request shape.

    prompt        decode_request(req)            the worker computes the prompt (direct
                                                 path), all n completions of it
    hand-off      decode_request(req, handoff)   one completion, from the first token the
                                                 prefill sampled and the KV it left
    resumed       resumed_request(request, sent) any of the two, after the tokens already
                                                 sent, on another worker (migration.py)
"""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.services.pb import common_pb2, decode_pb2
from pdserve.services.router.core.request import RoutedRequest


@dataclass(frozen=True)
class Handoff:
    """What a prefill left for the decode that continues one completion."""
    first_token_id: int
    kv_handle: common_pb2.KVHandle
    # n > 1: the completions' decodes read under one lease, which the router releases
    # once all have read; else the one decode takes the lease over and releases it
    shared_lease: bool = False


def decode_request(req: RoutedRequest, handoff: Handoff | None = None) -> decode_pb2.DecodeRequest:
    request = decode_pb2.DecodeRequest(req_id=req.req_id, prompt_token_ids=req.prompt_token_ids,
                                       sampling=req.sampling, priority=req.slo.priority,
                                       slo=req.decode_slo(), cache_salt=req.cache_salt)
    if handoff is None:  # the prompt is computed there: chunked to the path's ITL budget, once for all n
        request.prefill_chunk_tokens = req.prefill_chunk_tokens
        request.n = req.n
    else:
        request.first_token_id = handoff.first_token_id
        request.kv_handle.CopyFrom(handoff.kv_handle)
        request.shared_lease = handoff.shared_lease
    return request


def resumed_request(request: decode_pb2.DecodeRequest, sent_token_ids: list[int],
                    kvstore_up: bool) -> decode_pb2.DecodeRequest:
    """`request` continued after the tokens already sent. Its KV handle stays (without
    the lease, which the broken decode released when it took over) for the new worker to
    import what the kvstore still holds; with the kvstore down it recomputes instead."""
    resumed = decode_pb2.DecodeRequest()
    resumed.CopyFrom(request)
    resumed.ClearField("first_token_id")
    resumed.output_token_ids[:] = sent_token_ids
    if kvstore_up and request.kv_handle.kvstore_address:
        resumed.kv_handle.lease_id = ""
    else:
        resumed.ClearField("kv_handle")
    return resumed
