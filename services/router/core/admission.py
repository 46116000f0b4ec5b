"""Admission: what a request does when every worker it could use is saturated.

It waits, bounded, in one queue per SLO class; whenever capacity may have appeared (a
request finished, a poll came back) the head of the queue tries again. The head is the
oldest request of the most urgent class that has one waiting, so interactive work is
never queued behind batch work:

    interactive  [i3]              <- head: served first
    batch        [b1, b2, b4]      <- waits until no interactive request is waiting

A new request that finds no one of its own or a more urgent class waiting goes straight
to a worker; otherwise it queues. A request that waits past its class's bound, or finds
the queues full, is refused (RESOURCE_EXHAUSTED with a retry hint, see pools.py).
"""
from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from pdserve.services.router.core.cancel import Cancellation

T = TypeVar("T")


@dataclass(eq=False)
class Ticket:
    slo_class: str
    priority: int  # lower is more urgent
    seq: int = field(default_factory=itertools.count().__next__)


class AdmissionQueue:
    """Per-class FIFO queues ordered by class priority. Not thread-safe: the gate locks.
    An OrderedDict per class gives O(1) removal from the middle (a waiter that times out
    or is cancelled leaves wherever it is)."""

    def __init__(self) -> None:
        self._classes: dict[int, dict[str, OrderedDict[int, Ticket]]] = {}

    def push(self, ticket: Ticket) -> None:
        self._classes.setdefault(ticket.priority, {}).setdefault(ticket.slo_class, OrderedDict())[ticket.seq] = ticket

    def remove(self, ticket: Ticket) -> None:
        by_name = self._classes.get(ticket.priority, {})
        by_name.get(ticket.slo_class, {}).pop(ticket.seq, None)

    def head(self) -> Ticket | None:
        """The oldest ticket of the most urgent priority that has one."""
        for priority in sorted(self._classes):
            oldest = [next(iter(q.values())) for q in self._classes[priority].values() if q]
            if oldest:
                return min(oldest, key=lambda t: t.seq)
        return None

    def num_ahead_or_level(self, priority: int) -> int:
        """Waiters a new request of `priority` must not overtake: same or more urgent."""
        return sum(len(q) for p, by_name in self._classes.items() if p <= priority for q in by_name.values())

    def num_waiting(self, slo_class: str | None = None) -> int:
        return sum(len(q) for by_name in self._classes.values() for name, q in by_name.items()
                   if slo_class is None or name == slo_class)

    def __len__(self) -> int:
        return self.num_waiting()


class AdmissionGate:
    """One pool's admission: `acquire` returns what `pick` grants, in queue order."""

    def __init__(self, max_queued: int, on_queue_change: Callable[[str, int], None] = lambda c, n: None):
        self._max_queued = max_queued
        self._queue = AdmissionQueue()
        self._cond = threading.Condition()
        self._on_queue_change = on_queue_change

    def acquire(self, ticket: Ticket, pick: Callable[[], T | None], wait_s: float,
                cancel: Cancellation) -> T | None:
        """`pick` runs under the gate's lock (so two requests never take the same last
        slot) and may raise; None means "nothing free". Returns None when the wait ran out
        or the queue is full; raises Cancelled when the request was cancelled."""
        with self._cond:
            if self._queue.num_ahead_or_level(ticket.priority) == 0:
                granted = pick()
                if granted is not None:
                    return granted
            if len(self._queue) >= self._max_queued or wait_s <= 0:
                return None
            return self._wait(ticket, pick, time.monotonic() + wait_s, cancel)

    def wake(self) -> None:
        """Capacity may have changed: let the head try again."""
        with self._cond:
            self._cond.notify_all()

    def num_waiting(self, slo_class: str | None = None) -> int:
        with self._cond:
            return self._queue.num_waiting(slo_class)

    def _wait(self, ticket: Ticket, pick, deadline: float, cancel: Cancellation):
        self._push(ticket)
        unregister = cancel.on_cancel(self.wake)
        try:
            while True:
                cancel.raise_if_cancelled()
                if self._queue.head() is ticket:
                    granted = pick()
                    if granted is not None:
                        return granted
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cond.wait(remaining)
        finally:
            unregister()
            self._queue.remove(ticket)
            self._on_queue_change(ticket.slo_class, self._queue.num_waiting(ticket.slo_class))
            self._cond.notify_all()  # the next head may go now

    def _push(self, ticket: Ticket) -> None:
        self._queue.push(ticket)
        self._on_queue_change(ticket.slo_class, self._queue.num_waiting(ticket.slo_class))
