"""A request's n completions (GenerateRequest.n > 1): one prefill of the prompt, then each
completion's own stream, all merged into the request's one stream, tagged with its index.
The parts parallel.py puts together: completion(), SharedLease, merged().

    disaggregated: prefill(prompt, n) ─▶ n first tokens + one KVHandle (one write, one lease)
                     ├─▶ decode(first 0, handle) ─▶ completion 0 ─┐
                     ├─▶ decode(first 1, handle) ─▶ completion 1 ─┼─▶ merged ─▶ the client
                     └─▶ ...                                      ┘
    direct:        decode(prompt, n) on one worker: its engine computes the prompt once
                   (engine/parallel_sampling.py) and streams the n completions interleaved;
                   if that stream breaks, each unfinished completion goes on alone

Completion i is a request of its own from the first token on: seed + i (vLLM's rule, so it
gives exactly the tokens of a single request with that seed), n 1, its own id on the
workers (two completions may meet on one decode worker), its own retries and migration.
The decodes share the prefill's lease (DecodeRequest.shared_lease): each reads under it
and the router releases it once the last has read, or will never read (SharedLease).
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace

from pdserve.services.pb import common_pb2
from pdserve.services.router.core.cancel import Cancellation
from pdserve.services.router.core.request import RoutedRequest

JOIN_TIMEOUT_S = 10.0  # at the end: how long a cancelled completion may take to leave its calls
_END = object()

Run = Callable[[Cancellation], Iterator[common_pb2.GenerateResponse]]


def completion(req: RoutedRequest, index: int) -> RoutedRequest:
    """Completion `index` of `req` as a request of its own (`req` itself when n is 1)."""
    if req.n == 1:
        return req
    sampling = common_pb2.SamplingParams()
    sampling.CopyFrom(req.sampling)
    if sampling.HasField("seed"):
        sampling.seed += index  # the validator bounded seed + n - 1 to the wire's int64
    return replace(req, req_id=f"{req.req_id}-{index}", sampling=sampling, n=1, index=index)


class SharedLease:
    """The prefill's lease, read under by `num_readers` decodes: released when the last of
    them has read (or will never read: it ended, or failed, before), or by release()."""

    def __init__(self, release: Callable[[str], None], lease_id: str, num_readers: int):
        self._release = release
        self._lock = threading.Lock()
        self._lease_id = lease_id
        self._num_left = num_readers
        if num_readers == 0:
            self.release()

    def done_reading(self) -> None:
        """One decode has read (its first message came), or never will: call once per reader."""
        with self._lock:
            self._num_left -= 1
            last = self._num_left == 0
        if last:
            self.release()

    def read(self) -> None:  # completions.Lease: a reader that read and one that never will count alike
        self.done_reading()

    def not_read(self) -> None:
        self.done_reading()

    def release(self) -> None:
        with self._lock:
            lease_id, self._lease_id = self._lease_id, ""
        if lease_id:
            self._release(lease_id)


def merged(runs: list[Run], cancel: Cancellation) -> Iterator[common_pb2.GenerateResponse]:
    """The runs' messages as they come, each run on a thread of its own (their calls block)
    with its own Cancellation, which the request's cancels. A run's failure cancels the
    others and is raised; closing the iterator (the client went away) cancels them all.
    Either way the runs have left their calls (their leases released) when it returns.

        thread 0: run 0 ──┐
        thread 1: run 1 ──┼─▶ queue ─▶ the request's stream
        ...             ──┘
    """
    items: queue.SimpleQueue = queue.SimpleQueue()
    cancels = [Cancellation() for _ in runs]
    unregister = [cancel.on_cancel(c.cancel) for c in cancels]
    threads = [threading.Thread(target=_pump, args=(run, c, items), name="completion", daemon=True)
               for run, c in zip(runs, cancels)]
    for thread in threads:
        thread.start()
    num_open = len(runs)
    try:
        while num_open:
            item = items.get()
            if item is _END:
                num_open -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for c in cancels:
            c.cancel()  # a no-op for a run that ended
        for thread in threads:
            thread.join(JOIN_TIMEOUT_S)
        for fn in unregister:
            fn()


def _pump(run: Run, cancel: Cancellation, items: queue.SimpleQueue) -> None:
    try:
        for msg in run(cancel):
            items.put(msg)
        items.put(_END)
    except BaseException as e:  # handed to the reader, who raises it in the request's thread
        items.put(e)
