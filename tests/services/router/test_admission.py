"""The admission queues: interactive work is never queued behind batch work."""
from __future__ import annotations

import threading

import pytest

from pdserve.services.router.core.admission import AdmissionGate, AdmissionQueue, Ticket
from pdserve.services.router.core.cancel import Cancellation, Cancelled
from tests.services.router.fakes import wait_until


def test_queue_serves_the_most_urgent_class_first_then_fifo():
    q = AdmissionQueue()
    # in order of arrival; "realtime" is another class of interactive's priority: FIFO with it
    b1, i1, b2, r1, i2 = (Ticket("batch", 1), Ticket("interactive", 0), Ticket("batch", 1),
                          Ticket("realtime", 0), Ticket("interactive", 0))
    for t in (b1, i1, b2, r1, i2):
        q.push(t)
    order = []
    while (head := q.head()) is not None:
        order.append(head)
        q.remove(head)
    assert order == [i1, r1, i2, b1, b2]


def test_queue_counts_and_removal_from_the_middle():
    q = AdmissionQueue()
    tickets = [Ticket("batch", 1) for _ in range(3)] + [Ticket("interactive", 0)]
    for t in tickets:
        q.push(t)
    q.remove(tickets[1])
    assert (len(q), q.num_waiting("batch"), q.num_waiting("interactive")) == (3, 2, 1)
    assert q.num_ahead_or_level(0) == 1 and q.num_ahead_or_level(1) == 3
    q.remove(tickets[1])  # twice: no error
    assert len(q) == 3


class _Slots:
    """A pool with a number of free slots; records who got one, in order."""

    def __init__(self) -> None:
        self.free = 0
        self.granted: list[str] = []
        self.asked: list[str] = []
        self._lock = threading.Lock()

    def add(self, n: int = 1) -> None:
        with self._lock:
            self.free += n

    def pick_for(self, name: str):
        def pick():
            with self._lock:
                self.asked.append(name)
                if self.free == 0:
                    return None
                self.free -= 1
                self.granted.append(name)
                return name
        return pick


def _waiter(gate, slots, results, name, slo_class, priority):
    def run():
        results[name] = gate.acquire(Ticket(slo_class, priority), slots.pick_for(name), 30.0, Cancellation())
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_interactive_is_never_queued_behind_batch():
    gate, slots, results = AdmissionGate(max_queued=10), _Slots(), {}
    threads = []
    for name in ("b1", "b2"):
        threads.append(_waiter(gate, slots, results, name, "batch", 1))
        wait_until(lambda n=len(threads): gate.num_waiting("batch") == n, f"{name} queued")
    threads.append(_waiter(gate, slots, results, "i1", "interactive", 0))
    wait_until(lambda: gate.num_waiting("interactive") == 1, "i1 queued")
    # a batch request arriving now queues without even trying: an interactive one is waiting
    threads.append(_waiter(gate, slots, results, "b3", "batch", 1))
    wait_until(lambda: gate.num_waiting("batch") == 3, "b3 queued")
    assert "b3" not in slots.asked
    for n in range(1, 5):
        slots.add()
        gate.wake()
        wait_until(lambda: len(slots.granted) == n, f"grant {n}")
    for t in threads:
        t.join(timeout=10)
    assert slots.granted == ["i1", "b1", "b2", "b3"]
    assert results == {name: name for name in slots.granted}
    assert gate.num_waiting() == 0


def test_an_interactive_request_overtakes_waiting_batch_work_when_a_slot_is_free():
    gate, slots, results = AdmissionGate(max_queued=10), _Slots(), {}
    thread = _waiter(gate, slots, results, "b1", "batch", 1)
    wait_until(lambda: gate.num_waiting("batch") == 1, "b1 queued")
    slots.add()  # a slot frees without waking anyone yet
    granted = gate.acquire(Ticket("interactive", 0), slots.pick_for("i1"), 0.0, Cancellation())
    assert granted == "i1" and gate.num_waiting("batch") == 1
    slots.add()
    gate.wake()
    thread.join(timeout=10)
    assert slots.granted == ["i1", "b1"]


def test_wait_runs_out_and_full_queue_refuses():
    gate, slots = AdmissionGate(max_queued=1), _Slots()
    assert gate.acquire(Ticket("interactive", 0), slots.pick_for("x"), 0.0, Cancellation()) is None
    assert gate.acquire(Ticket("interactive", 0), slots.pick_for("y"), 0.05, Cancellation()) is None
    assert gate.num_waiting() == 0
    results = {}
    thread = _waiter(gate, slots, results, "w", "batch", 1)
    wait_until(lambda: gate.num_waiting() == 1, "w queued")
    # the queue holds one: the next request is refused at once, however long it would wait
    assert gate.acquire(Ticket("interactive", 0), slots.pick_for("z"), 30.0, Cancellation()) is None
    slots.add()
    gate.wake()
    thread.join(timeout=10)
    assert results == {"w": "w"}


def test_cancel_ends_the_wait():
    gate, slots = AdmissionGate(max_queued=10), _Slots()
    cancel, outcome = Cancellation(), []

    def run():
        try:
            gate.acquire(Ticket("interactive", 0), slots.pick_for("c"), 30.0, cancel)
        except Cancelled:
            outcome.append("cancelled")
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    wait_until(lambda: gate.num_waiting() == 1, "queued")
    cancel.cancel()
    thread.join(timeout=10)
    assert outcome == ["cancelled"] and gate.num_waiting() == 0


def test_cancellation_runs_callbacks_once_and_late_ones_at_once():
    cancel, calls = Cancellation(), []
    unregister = cancel.on_cancel(lambda: calls.append("a"))
    cancel.on_cancel(lambda: calls.append("b"))
    unregister()
    cancel.cancel()
    cancel.cancel()
    cancel.on_cancel(lambda: calls.append("late"))
    assert calls == ["b", "late"]
    with pytest.raises(Cancelled):
        cancel.raise_if_cancelled()
