"""Saturation, unreachable pools, failing workers and cancelled clients."""
from __future__ import annotations

import threading

import grpc
import pytest

from pdserve.engine import SamplingParams
from pdserve.services.router.client import RouterClient
from pdserve.services.router.config import SaturationConfig, SLOClass
from pdserve.services.router.state.discovery import DECODE, PREFILL
from tests.services.router.fakes import WORKER_RETRY_AFTER_MS, address_of, expected_tokens, wait_until

SHORT = list(range(100, 110))
LONG = list(range(200, 264))
NO_WAIT = {"interactive": SLOClass(1000, 100, 0, max_queue_ms=0), "batch": SLOClass(10000, 1000, 1, max_queue_ms=0)}


def _generate(client, prompt, max_tokens=4, **kw):
    return list(client.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens), timeout_s=30, **kw))


def _tokens(msgs):
    return [t for m in msgs for t in m.token_ids]


def _error(client, prompt, **kw) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        _generate(client, prompt, **kw)
    return e.value


def _views(cluster, pool):
    return {v.address: v for v in cluster.router.registry.views(pool)}


@pytest.mark.parametrize("prompt,pool", [(SHORT, "decodes"), (LONG, "prefills")])
def test_saturated_pool_is_resource_exhausted_with_retry_hint(make_cluster, prompt, pool):
    cluster = make_cluster(slo_classes=NO_WAIT, retry_after_ms=750)
    for worker in getattr(cluster, pool):
        worker.load.num_waiting = 32  # SaturationConfig.max_waiting
    cluster.router.poll_now()
    with RouterClient(cluster.router.address) as client:
        error = _error(client, prompt)
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "saturated" in error.details()
        assert dict(error.trailing_metadata())["retry-after-ms"] == "750"
        assert all(not w.requests for w in cluster.prefills + cluster.decodes)
        name = PREFILL if pool == "prefills" else DECODE
        assert cluster.router.metrics.metrics.value("router_admission_rejections_total",
                                                    {"pool": name, "slo_class": "interactive"}) == 1
        # once a worker has room again, the same request goes through
        getattr(cluster, pool)[1].load.num_waiting = 0
        cluster.router.poll_now()
        assert _tokens(_generate(client, prompt)) == expected_tokens(len(prompt), 4)


def test_router_in_flight_limit_saturates_a_worker(make_cluster):
    cluster = make_cluster(num_decode=1, slo_classes=NO_WAIT, saturation=SaturationConfig(max_in_flight_per_worker=1))
    decode = cluster.decodes[0]
    decode.hold = threading.Event()
    with RouterClient(cluster.router.address) as client:
        held = client.generate(SHORT, SamplingParams(max_tokens=3), timeout_s=30)
        held_iter = iter(held)
        wait_until(decode.holding.is_set, "the first request reached the decode")
        error = _error(client, SHORT)
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        decode.hold.set()
        assert _tokens(list(held_iter)) == expected_tokens(len(SHORT), 3)


@pytest.mark.parametrize("prompt", [SHORT, LONG])
def test_no_reachable_decode_worker_is_unavailable(make_cluster, prompt):
    cluster = make_cluster()
    for worker in cluster.decodes:
        cluster.stop_worker(worker)
    cluster.router.poll_now()
    with RouterClient(cluster.router.address) as client:
        error = _error(client, prompt)
        assert error.code() == grpc.StatusCode.UNAVAILABLE and "reachable" in error.details()
    assert all(not w.requests for w in cluster.prefills)  # never spent a prefill it could not finish


def test_no_reachable_prefill_worker_falls_back_to_the_decode_pool(make_cluster):
    cluster = make_cluster()
    for worker in cluster.prefills:
        cluster.stop_worker(worker)
    cluster.router.poll_now()
    with RouterClient(cluster.router.address) as client:
        assert _tokens(_generate(client, LONG)) == expected_tokens(len(LONG), 4)  # prefilled by a decode worker
        assert _tokens(_generate(client, SHORT)) == expected_tokens(len(SHORT), 4)
    assert cluster.router.servicer.metrics.prefill_fallbacks._value.get() == 1


def test_workers_failing_polls_are_down_until_they_answer_again(cluster, client):
    first, second = cluster.prefills
    first.load_fails = True
    cluster.router.poll_now()
    assert not _views(cluster, PREFILL)[address_of(cluster, first)].up
    assert cluster.router.metrics.metrics.value("router_workers_up", {"pool": PREFILL}) == 1
    for i in range(4):
        _generate(client, [i] * 16 + LONG)
    assert len(second.requests) == 4 and not first.requests
    first.load_fails = False
    cluster.router.poll_now()
    assert _views(cluster, PREFILL)[address_of(cluster, first)].up
    assert cluster.router.metrics.metrics.value("router_workers_up", {"pool": PREFILL}) == 2


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL,
                                  grpc.StatusCode.DEADLINE_EXCEEDED])
def test_failing_prefill_worker_is_retried_once_on_the_other(cluster, client, code):
    failing, healthy = cluster.prefills
    failing.fail_with = code
    healthy.load.num_queued_prefill_tokens = 10_000  # so the failing one is tried first
    cluster.router.poll_now()
    msgs = _generate(client, LONG)
    assert _tokens(msgs) == expected_tokens(len(LONG), 4) and msgs[-1].usage.completion_tokens == 4
    assert (len(failing.requests), len(healthy.requests)) == (1, 1)
    assert cluster.router.metrics.metrics.value("router_retries_total", {"pool": PREFILL}) == 1


def test_prefill_failing_everywhere_fails_after_one_retry(cluster, client):
    for p in cluster.prefills:
        p.fail_with = grpc.StatusCode.INTERNAL
    error = _error(client, LONG)
    assert error.code() == grpc.StatusCode.INTERNAL and "injected failure" in error.details()
    assert [len(p.requests) for p in cluster.prefills] == [1, 1]
    assert all(not d.requests for d in cluster.decodes)


def test_single_prefill_worker_down_falls_back_to_the_decode_pool(make_cluster):
    cluster = make_cluster(num_prefill=1)
    cluster.prefills[0].fail_with = grpc.StatusCode.UNAVAILABLE
    with RouterClient(cluster.router.address) as client:
        assert _tokens(_generate(client, LONG)) == expected_tokens(len(LONG), 4)
    assert len(cluster.prefills[0].requests) == 1  # tried, failed, marked down: nothing was sent yet
    assert cluster.router.servicer.metrics.prefill_fallbacks._value.get() == 1


def test_single_prefill_worker_failure_reports_the_cause(make_cluster):
    # a failure that does not mean the worker is gone: no other worker, so the client learns why
    cluster = make_cluster(num_prefill=1)
    cluster.prefills[0].fail_with = grpc.StatusCode.DEADLINE_EXCEEDED
    with RouterClient(cluster.router.address) as client:
        error = _error(client, LONG)
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "injected failure" in error.details()
    assert cluster.router.servicer.metrics.prefill_fallbacks._value.get() == 0


def test_invalid_argument_from_a_worker_is_not_retried(cluster, client):
    for p in cluster.prefills:
        p.fail_with = grpc.StatusCode.INVALID_ARGUMENT
    error = _error(client, LONG)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert sum(len(p.requests) for p in cluster.prefills) == 1


@pytest.mark.parametrize("prompt", [SHORT, LONG])
def test_failing_decode_before_any_token_is_retried_on_the_other(cluster, client, prompt):
    failing, healthy = cluster.decodes
    failing.fail_with = grpc.StatusCode.UNAVAILABLE
    healthy.load.num_running = 6  # so the failing one is tried first
    cluster.router.poll_now()
    msgs = _generate(client, prompt)
    assert _tokens(msgs) == expected_tokens(len(prompt), 4)
    assert (len(failing.requests), len(healthy.requests)) == (1, 1)
    assert healthy.requests[0].kv_handle == failing.requests[0].kv_handle  # the same leased KV
    assert cluster.kvstore.releases == []  # the healthy decode took the lease over
    assert cluster.router.metrics.metrics.value("router_retries_total", {"pool": DECODE}) == 1
    assert not _views(cluster, DECODE)[address_of(cluster, failing)].up


def _migrations(cluster, reason: str) -> float:
    return cluster.router.metrics.metrics.value("router_migrations_total", {"reason": reason})


def test_decode_failing_mid_stream_resumes_after_the_tokens_sent(cluster, client):
    for d in cluster.decodes:
        d.fail_after = 2
    msgs = list(client.generate(LONG, SamplingParams(max_tokens=5), timeout_s=30))
    # the first token from the prefill, two from the broken decode, the rest from the other:
    # every token once, in order, and the text of each exactly once
    assert _tokens(msgs) == expected_tokens(len(LONG), 5)
    assert "".join(m.text for m in msgs) == "".join(f"<{t}>" for t in expected_tokens(len(LONG), 5))
    assert msgs[-1].finish_reason == "length" and msgs[-1].usage.completion_tokens == 5
    broken, resumed = sorted((r for d in cluster.decodes for r in d.requests), key=lambda r: len(r.output_token_ids))
    assert broken.HasField("first_token_id") and not broken.output_token_ids
    assert list(resumed.output_token_ids) == expected_tokens(len(LONG), 3)
    assert not resumed.HasField("first_token_id") and resumed.kv_handle.block_hashes == broken.kv_handle.block_hashes
    assert _migrations(cluster, "unavailable") == 1
    assert cluster.kvstore.releases == []  # the first decode had taken the lease over


def test_migrations_per_request_are_bounded(make_cluster):
    cluster = make_cluster(num_decode=3)
    for d in cluster.decodes:
        d.fail_after = 1
    with RouterClient(cluster.router.address) as client:
        stream = client.generate(LONG, SamplingParams(max_tokens=16), timeout_s=30)
        received = []
        with pytest.raises(grpc.RpcError) as e:
            for msg in stream:
                received.extend(msg.token_ids)
    # first token, then one from each of three decodes: two migrations, then the error
    assert received == expected_tokens(len(LONG), 4)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "mid-stream after 4 tokens" in e.value.details()
    assert [len(d.requests) for d in cluster.decodes] == [1, 1, 1]
    assert _migrations(cluster, "unavailable") == 2


def test_a_clear_answer_mid_stream_ends_the_request(cluster, client):
    for d in cluster.decodes:
        d.fail_after, d.fail_code = 2, grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as e:
        _generate(client, SHORT, max_tokens=8)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert sum(len(d.requests) for d in cluster.decodes) == 1
    assert _migrations(cluster, "unavailable") == 0


def test_a_stream_on_a_worker_that_stops_answering_polls_moves_on(cluster, client):
    for d in cluster.decodes:
        d.hold, d.hold_after = threading.Event(), 2
    stream = client.generate(SHORT, SamplingParams(max_tokens=6), timeout_s=30)
    received = []
    for msg in stream:  # two tokens, then the worker hangs
        received.extend(msg.token_ids)
        if len(received) == 2:
            break
    hung = next(d for d in cluster.decodes if d.holding.is_set())
    other = next(d for d in cluster.decodes if d is not hung)
    other.hold = None
    hung.load_fails = True
    cluster.router.poll_now()  # the hung worker does not answer: its stream is given up
    received.extend(t for msg in stream for t in msg.token_ids)
    assert received == expected_tokens(len(SHORT), 6)
    assert list(other.requests[0].output_token_ids) == expected_tokens(len(SHORT), 2)
    assert _migrations(cluster, "worker_lost") == 1
    wait_until(hung.saw_cancel.is_set, "the hung worker's call was cancelled")


def test_queued_requests_are_not_prefilled_once_no_decode_worker_is_left(make_cluster):
    slow = {"interactive": SLOClass(1000, 100, 0, max_queue_ms=30000), "batch": SLOClass(10000, 1000, 1)}
    cluster = make_cluster(slo_classes=slow)
    for p in cluster.prefills:
        p.load.num_waiting = 32  # saturated: the request waits in the router's admission queue
    cluster.router.poll_now()
    with RouterClient(cluster.router.address) as client:
        errors = []
        waiting = threading.Thread(target=lambda: errors.append(_error(client, LONG)))
        waiting.start()
        wait_until(lambda: cluster.router.metrics.metrics.value(
            "router_queued_requests", {"pool": PREFILL, "slo_class": "interactive"}) == 1, "the request queued")
        for d in cluster.decodes:
            cluster.stop_worker(d)
        cluster.router.poll_now()
        # the router learns of the dead decode pool first (a request released into prefill
        # while the router still believed in its decode workers would be a different race)
        wait_until(lambda: cluster.router.metrics.metrics.value("router_workers_up", {"pool": DECODE}) == 0,
                   "the router saw the decode pool go")
        for p in cluster.prefills:
            p.load.num_waiting = 0
        cluster.router.poll_now()  # the prefill pool has room again
        waiting.join(timeout=10)
    assert errors and errors[0].code() == grpc.StatusCode.UNAVAILABLE and "no decode worker" in errors[0].details()
    assert all(not p.requests for p in cluster.prefills)


def test_kvstore_down_sends_long_prompts_direct(cluster, client):
    cluster.stop_worker(cluster.kvstore)
    cluster.router.poll_now()
    assert not cluster.router.registry.kvstore.up
    assert _tokens(_generate(client, LONG)) == expected_tokens(len(LONG), 4)
    assert all(not p.requests for p in cluster.prefills)
    assert cluster.router.metrics.metrics.value("router_path_decisions_total",
                                                {"path": "direct", "reason": "kvstore_down"}) == 1
    assert cluster.router.metrics.metrics.value("router_kvstore_up") == 0


def test_decode_stream_ending_unfinished_is_an_error(cluster, client):
    # each worker ends its stream unfinished after two tokens: resumed once on the other,
    # then no worker is left and the client learns its answer is incomplete
    for d in cluster.decodes:
        d.end_after = 2
    with pytest.raises(grpc.RpcError) as e:
        _generate(client, SHORT, max_tokens=8)
    assert e.value.code() == grpc.StatusCode.INTERNAL and "without finishing" in e.value.details()
    assert "after 4 tokens" in e.value.details()
    assert _migrations(cluster, "incomplete_stream") == 1


def test_overloaded_workers_pass_their_retry_hint_on(cluster, client):
    for p in cluster.prefills:
        p.fail_with = grpc.StatusCode.RESOURCE_EXHAUSTED
    error = _error(client, LONG)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert dict(error.trailing_metadata())["retry-after-ms"] == WORKER_RETRY_AFTER_MS
    assert [len(p.requests) for p in cluster.prefills] == [1, 1]


def _outcome(cluster, outcome: str) -> float:
    return cluster.router.metrics.metrics.value("router_requests_total",
                                                {"slo_class": "interactive", "outcome": outcome})


def test_cancel_between_prefill_and_decode_releases_the_lease_once(cluster):
    for d in cluster.decodes:
        d.hold = threading.Event()
    client = RouterClient(cluster.router.address)
    stream = client.generate(LONG, SamplingParams(max_tokens=8), timeout_s=30)
    first = next(stream)
    assert list(first.token_ids) == [1000 + len(LONG)]
    wait_until(lambda: any(d.holding.is_set() for d in cluster.decodes), "the decode call arrived")
    stream.cancel()
    (decode,) = [d for d in cluster.decodes if d.requests]
    wait_until(decode.saw_cancel.is_set, "the decode saw its call cancelled")
    wait_until(lambda: _outcome(cluster, "cancelled") == 1, "the router finished the request")
    req_id = decode.requests[0].req_id
    assert cluster.kvstore.releases == [(f"lease-{req_id}", True)]
    client.close()


def test_cancel_mid_decode_leaves_the_lease_to_the_decode(cluster):
    for d in cluster.decodes:
        d.hold, d.hold_after = threading.Event(), 2
    client = RouterClient(cluster.router.address)
    stream = client.generate(LONG, SamplingParams(max_tokens=8), timeout_s=30)
    assert [next(stream).token_ids[0] for _ in range(3)] == expected_tokens(len(LONG), 3)
    stream.cancel()
    (decode,) = [d for d in cluster.decodes if d.requests]
    wait_until(decode.saw_cancel.is_set, "the decode saw its call cancelled")
    wait_until(lambda: _outcome(cluster, "cancelled") == 1, "the router finished the request")
    assert cluster.kvstore.releases == []
    client.close()


def test_cancel_during_prefill_cancels_the_prefill_call(cluster):
    for p in cluster.prefills:
        p.hold = threading.Event()
    client = RouterClient(cluster.router.address)
    stream = client.generate(LONG, SamplingParams(max_tokens=8), timeout_s=30)
    wait_until(lambda: any(p.holding.is_set() for p in cluster.prefills), "the prefill call arrived")
    stream.cancel()
    (prefill,) = [p for p in cluster.prefills if p.requests]
    wait_until(prefill.saw_cancel.is_set, "the prefill saw its call cancelled")
    wait_until(lambda: _outcome(cluster, "cancelled") == 1, "the router finished the request")
    assert all(not d.requests for d in cluster.decodes) and cluster.kvstore.releases == []
    client.close()


def test_router_serves_queued_interactive_before_batch(make_cluster):
    slow_queue = {"interactive": SLOClass(1000, 100, 0, max_queue_ms=30_000),
                  "batch": SLOClass(10000, 1000, 1, max_queue_ms=30_000)}
    cluster = make_cluster(num_decode=1, slo_classes=slow_queue,
                           saturation=SaturationConfig(max_in_flight_per_worker=1))
    decode, gate = cluster.decodes[0], cluster.router.pools[DECODE].gate
    decode.hold = threading.Event()
    results = {}

    def generate(name, slo_class):
        with RouterClient(cluster.router.address) as client:
            results[name] = _tokens(_generate(client, SHORT, slo_class=slo_class, req_id=name))
    threads = [threading.Thread(target=generate, args=("first", "interactive"))]
    threads[0].start()
    wait_until(decode.holding.is_set, "the first request holds the only slot")
    for name, slo_class in (("batch", "batch"), ("interactive", "interactive")):
        threads.append(threading.Thread(target=generate, args=(name, slo_class)))
        threads[-1].start()
        wait_until(lambda c=slo_class: gate.num_waiting(c) == 1, f"the {slo_class} request queued")
    decode.hold.set()
    for t in threads:
        t.join(timeout=30)
    # the worker knows requests by the router's ids; the classes' priorities show the order
    assert [r.priority for r in decode.requests] == [0, 0, 1]  # first, interactive, batch
    assert results == {name: expected_tokens(len(SHORT), 4) for name in ("first", "batch", "interactive")}
