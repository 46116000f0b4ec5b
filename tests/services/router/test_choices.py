"""services/router/core/choices.py without workers: the shared lease, and n runs merged
into one stream (a failure cancels the others; the reader leaving cancels them all)."""
from __future__ import annotations

import threading

import pytest

from pdserve.services.pb import common_pb2
from pdserve.services.router.core.cancel import Cancellation, Cancelled
from pdserve.services.router.core.choices import SharedLease, completion, merged
from pdserve.services.router.core.request import RoutedRequest
from pdserve.services.router.config import SLOClass

_SLO = SLOClass(ttft_ms=1000, itl_ms=100)


def test_shared_lease_is_released_once_after_the_last_reader():
    released = []
    lease = SharedLease(released.append, "L", 3)
    lease.done_reading()
    lease.done_reading()
    assert released == []
    lease.done_reading()
    lease.release()
    assert released == ["L"]
    SharedLease(released.append, "M", 0)  # nobody goes on: released at once
    assert released == ["L", "M"]


def test_a_completion_is_seed_plus_index_with_its_own_worker_id():
    req = RoutedRequest("r", (1, 2), common_pb2.SamplingParams(seed=10, temperature=0.5), "interactive", _SLO,
                        n=3)
    child = completion(req, 2)
    assert (child.req_id, child.n, child.index, child.sampling.seed) == ("r-2", 1, 2, 12)
    assert child.sampling.temperature == 0.5 and req.sampling.seed == 10
    unseeded = completion(RoutedRequest("u", (1,), common_pb2.SamplingParams(), "interactive", _SLO, n=2), 1)
    assert not unseeded.sampling.HasField("seed")
    assert completion(RoutedRequest("one", (1,), common_pb2.SamplingParams(), "interactive", _SLO), 0).req_id == "one"


def _msg(index: int) -> common_pb2.GenerateResponse:
    return common_pb2.GenerateResponse(index=index)


def _blocking(index: int, cancelled: list):
    def run(cancel: Cancellation):
        yield _msg(index)
        stop = threading.Event()
        cancel.on_cancel(stop.set)
        stop.wait(10)
        cancelled.append(index)
        raise Cancelled()
    return run


def test_merged_yields_every_message_until_all_runs_end():
    runs = [lambda c, i=i: iter([_msg(i), _msg(i)]) for i in range(3)]
    assert sorted(m.index for m in merged(runs, Cancellation())) == [0, 0, 1, 1, 2, 2]


def test_a_failing_run_cancels_the_others_and_is_raised():
    cancelled: list = []

    def failing(cancel):
        yield _msg(0)
        raise RuntimeError("worker said no")
    with pytest.raises(RuntimeError, match="worker said no"):
        list(merged([failing, _blocking(1, cancelled), _blocking(2, cancelled)], Cancellation()))
    assert sorted(cancelled) == [1, 2]  # and they had left when merged returned


def test_the_reader_leaving_or_the_request_cancelled_cancels_every_run():
    cancelled: list = []
    stream = merged([_blocking(0, cancelled), _blocking(1, cancelled)], Cancellation())
    next(stream)
    stream.close()
    assert sorted(cancelled) == [0, 1]
    cancelled.clear()
    request = Cancellation()
    stream = merged([_blocking(0, cancelled), _blocking(1, cancelled)], request)
    next(stream)
    request.cancel()
    with pytest.raises(Cancelled):
        list(stream)
    assert sorted(cancelled) == [0, 1]
