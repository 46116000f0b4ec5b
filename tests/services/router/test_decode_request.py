"""services/router/core/decode_request.py, completions.py and stream.py without workers: the
three DecodeRequest starts field by field, the lease one decode takes over, and a decode's
message relabelled in place."""
from __future__ import annotations

from dataclasses import replace

from pdserve.services.pb import common_pb2
from pdserve.services.router.config import SLOClass
from pdserve.services.router.core.choices import completion
from pdserve.services.router.core.completions import HandedOverLease
from pdserve.services.router.core.decode_request import Handoff, decode_request, resumed_request
from pdserve.services.router.core.request import RoutedRequest
from pdserve.services.router.core.stream import ResponseStream
from pdserve.services.router.metrics import RouterMetrics

_SLO = SLOClass(ttft_ms=1000, itl_ms=100, priority=1)
_REQ = RoutedRequest("r", (1, 2, 3), common_pb2.SamplingParams(seed=5, max_tokens=4), "batch", _SLO,
                     prefill_chunk_tokens=64, cache_salt="salt", n=2)
_HANDLE = common_pb2.KVHandle(block_hashes=[b"h0"], tail_key="r/tail", num_tokens=3, lease_id="L",
                              kvstore_address="127.0.0.1:9")


def test_a_prompt_request_asks_the_worker_for_every_completion_chunked():
    request = decode_request(_REQ)
    assert (request.req_id, list(request.prompt_token_ids), request.sampling.seed) == ("r", [1, 2, 3], 5)
    assert (request.priority, request.slo.itl_target_ms, request.cache_salt) == (1, 100, "salt")
    assert (request.n, request.prefill_chunk_tokens) == (2, 64)
    assert not request.HasField("first_token_id") and not request.HasField("kv_handle")
    assert not request.shared_lease


def test_a_handoff_continues_one_completion_from_its_first_token():
    child = completion(_REQ, 1)
    request = decode_request(child, Handoff(42, _HANDLE, shared_lease=True))
    assert (request.req_id, request.sampling.seed, request.first_token_id) == ("r-1", 6, 42)
    assert request.kv_handle == _HANDLE and request.shared_lease
    assert (request.n, request.prefill_chunk_tokens) == (0, 0)  # one completion, prefilled elsewhere
    alone = decode_request(replace(_REQ, n=1), Handoff(42, _HANDLE))
    assert not alone.shared_lease and alone.kv_handle.lease_id == "L"


def test_a_resumed_request_continues_after_the_tokens_sent_without_the_lease():
    handed = decode_request(replace(_REQ, n=1), Handoff(42, _HANDLE))
    resumed = resumed_request(handed, [42, 7], kvstore_up=True)
    assert not resumed.HasField("first_token_id") and list(resumed.output_token_ids) == [42, 7]
    assert resumed.kv_handle.block_hashes == [b"h0"] and not resumed.kv_handle.lease_id
    assert not resumed_request(handed, [42], kvstore_up=False).HasField("kv_handle")  # recomputed instead
    assert handed.first_token_id == 42 and handed.kv_handle.lease_id == "L"  # the request itself is left alone


def test_the_lease_one_decode_takes_over_is_the_routers_only_until_it_reads():
    released = []
    read = HandedOverLease(released.append, "L")
    read.read()
    read.release()
    assert released == []  # the decode worker released it
    unread = HandedOverLease(released.append, "M")
    unread.not_read()
    unread.release()
    unread.release()
    assert released == ["M"]  # once


def test_a_decode_message_is_relabelled_in_place_with_its_completion_index():
    stream = ResponseStream(completion(_REQ, 1), arrival=0.0, metrics=RouterMetrics({"batch": _SLO}),
                            label_req_id="client-id")
    msg = common_pb2.GenerateResponse(req_id="r-1", token_ids=[9], text="x")
    assert stream.forward(msg) is msg
    assert (msg.req_id, msg.index, stream.token_ids) == ("client-id", 1, [9])
