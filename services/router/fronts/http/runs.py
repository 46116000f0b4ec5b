"""The choices of one HTTP request running side by side, between threads and the event loop.

The routing flow blocks (admission waits, gRPC calls), so each prompt's run (its n
completions, the prompt prefilled once: core/choices.py) runs it in a worker thread; its
messages come to the event loop through one queue, tagged with the choice's index (the
run's first choice plus the message's completion index). Cancelling the group cancels
every run's `Cancellation`, which is exactly what a gRPC client's cancel does: the
admission wait ends, worker calls are cancelled (the workers free their blocks) and a
lease no decode took over is released.

    thread 0: flow.run(prompt 0, n) ──┐
    thread 1: flow.run(prompt 1, n) ──┼─▶ queue[(choice, msg | error | END)] ─▶ next()
    ...                               ┘
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from concurrent.futures import Executor

from pdserve.services.pb import common_pb2
from pdserve.services.router.core.cancel import Cancellation
from pdserve.services.router.core.request import RoutedRequest
from pdserve.services.router.fronts.http.backend import Backend

logger = logging.getLogger(__name__)

_END = object()
Message = tuple[int, common_pb2.GenerateResponse]


class RunGroup:
    def __init__(self, backend: Backend, requests: Sequence[RoutedRequest], arrival: float, executor: Executor):
        self._backend = backend
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._cancels = [Cancellation() for _ in requests]
        self._num_open = len(requests)
        # a run is one prompt's n completions: its messages' index counts from its first choice
        self._first_choice = [sum(r.n for r in requests[:i]) for i in range(len(requests))]
        self._num_choices = sum(r.n for r in requests)
        try:
            for index, req in enumerate(requests):
                executor.submit(self._pump, index, req, arrival)
        except RuntimeError:  # the executor is shut down: the server is stopping
            self.cancel()
            raise

    def __len__(self) -> int:
        """The choices (each run's n completions)."""
        return self._num_choices

    def cancel(self) -> None:
        """Abort every choice still running (a no-op for those that finished)."""
        for cancel in self._cancels:
            cancel.cancel()

    async def next(self) -> Message | None:
        """The next message of any choice; None when all have finished. A choice's failure
        (RouterError) is raised here, after the other choices are cancelled."""
        while self._num_open:
            index, item = await self._queue.get()
            if item is _END:
                self._num_open -= 1
            elif isinstance(item, BaseException):
                self._num_open -= 1
                self.cancel()
                raise item
            else:
                return index, item
        return None

    async def first_messages(self) -> list[Message]:
        """Messages until every choice has sent its first one: until then a refusal (429,
        503, ...) can still be the response's status rather than an error inside a stream."""
        got: list[Message] = []
        started: set[int] = set()
        while len(started) < len(self):
            message = await self.next()
            if message is None:
                break
            got.append(message)
            started.add(message[0])
        return got

    def _pump(self, index: int, req: RoutedRequest, arrival: float) -> None:
        cancel = self._cancels[index]
        try:
            for msg in self._backend.run(req, arrival, cancel):
                if not self._put(self._first_choice[index] + msg.index, msg):
                    cancel.cancel()  # the event loop is gone: nobody will read the rest
            item = _END
        except Exception as e:
            item = e
        self._put(index, item)

    def _put(self, index: int, item) -> bool:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, (index, item))
            return True
        except RuntimeError:  # the loop closed (server stopped)
            return False
