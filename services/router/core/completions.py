"""How a request's completions go on once its path is chosen: the flow's one fork on n,
decided once per request (completions_for), so flow.py runs the same steps for any n.

    OneCompletion        n = 1: the request is its one completion; its decode runs in the
                         request's thread and takes the prefill's lease over
    ParallelCompletions  n > 1 (parallel.py): one decode per completion side by side, under
                         the prefill's one lease, released by the router
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

from pdserve.services.pb import common_pb2
from pdserve.services.router.core.attempts import Attempts
from pdserve.services.router.core.cancel import Cancellation
from pdserve.services.router.core.choices import Run
from pdserve.services.router.core.decode_request import decode_request
from pdserve.services.router.core.parallel import ParallelCompletions
from pdserve.services.router.core.request import RoutedRequest
from pdserve.services.router.core.stream import ResponseStream

Messages = Iterator[common_pb2.GenerateResponse]


class Lease(Protocol):
    """The prefill's lease on the KV it left, as its decodes read it."""

    def read(self) -> None:
        """A decode has read the KV (its first message came)."""

    def not_read(self) -> None:
        """A decode ended (or failed) before it read the KV: it never will."""

    def release(self) -> None:
        """However the request ends, at the latest: release what the router still holds."""


class Completions(Protocol):
    """What depends on how many completions a request has; the rest of the flow does not."""
    shared_lease: bool  # DecodeRequest.shared_lease of each hand-off

    def direct(self, req: RoutedRequest, outs: list[ResponseStream], cancel: Cancellation,
               time_left: Callable[[], float | None]) -> Messages:
        """A decode worker computes the prompt and streams every completion."""

    def lease(self, release: Callable[[str], None], lease_id: str, num_readers: int) -> Lease:
        """The prefill's lease, read by `num_readers` decodes (the completions handed off)."""

    def side_by_side(self, runs: list[Run], cancel: Cancellation) -> Messages:
        """The handed-off completions' decodes, their messages as they come."""


class HandedOverLease:
    """A lease the one decode takes over when it reads (the decode worker releases it then);
    the router releases it only when no decode read it."""

    def __init__(self, release: Callable[[str], None], lease_id: str):
        self._release = release
        self._lease_id = lease_id

    def read(self) -> None:
        self._lease_id = ""  # the decode worker's now

    def not_read(self) -> None:
        """Nothing yet: release() follows at once, when the request ends."""

    def release(self) -> None:
        lease_id, self._lease_id = self._lease_id, ""
        if lease_id:
            self._release(lease_id)


class OneCompletion:
    shared_lease = False

    def __init__(self, attempts: Attempts):
        self.attempts = attempts

    def direct(self, req, outs, cancel, time_left):
        yield from self.attempts.decode(req, decode_request(req), len(req.prompt_token_ids), outs[0], cancel,
                                        time_left)

    def lease(self, release, lease_id, num_readers):
        return HandedOverLease(release, lease_id)

    def side_by_side(self, runs, cancel):
        for run in runs:  # none (the first token ended it) or one: no thread needed
            yield from run(cancel)


def completions_for(req: RoutedRequest, attempts: Attempts) -> Completions:
    return ParallelCompletions(attempts) if req.n > 1 else OneCompletion(attempts)
