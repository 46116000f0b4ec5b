"""A worker pool as the request flow sees it: `acquire` a slot on the best worker now,
or after a bounded wait in the admission queue, or fail with the reason.

    no worker reachable (all down, or all excluded)  -> UNAVAILABLE, at once
    all reachable workers saturated past the wait    -> RESOURCE_EXHAUSTED + retry hint
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import grpc

from pdserve.services.router.core.admission import AdmissionGate, Ticket
from pdserve.services.router.core.cancel import Cancellation
from pdserve.services.router.decide.policy import WorkerPolicy
from pdserve.services.router.decide.saturation import SaturationPolicy
from pdserve.services.router.decide.slots import choose_slot
from pdserve.services.router.decide.views import WorkerView
from pdserve.services.router.errors import RouterError
from pdserve.services.router.state.workers import WorkerRegistry


@dataclass
class Slot:
    """A request's place on one worker; `release` (idempotent) when the call is over."""
    pool: str
    address: str
    release: Callable[[], None]


@dataclass(frozen=True)
class Need:
    """What a request asks of a pool."""
    slo_class: str
    priority: int
    max_wait_s: float
    prompt_token_ids: Sequence[int]
    num_prefill_tokens: int         # what the worker will compute (0: a decode after a prefill)
    exclude: Collection[str] = ()   # workers that already failed this request


class Pool:
    def __init__(self, name: str, registry: WorkerRegistry, saturation: SaturationPolicy, policy: WorkerPolicy,
                 gate: AdmissionGate, retry_after_ms: int, on_reject: Callable[[str, str], None]):
        self.name = name
        self.registry = registry
        self.saturation = saturation
        self.gate = gate
        self.policy = policy
        self._retry_after_ms = retry_after_ms
        self._on_reject = on_reject

    def up_workers(self, exclude: Collection[str] = ()) -> list[WorkerView]:
        return [w for w in self.registry.views(self.name) if w.up and w.address not in exclude]

    def require_reachable(self) -> None:
        if not self.up_workers():
            raise RouterError(grpc.StatusCode.UNAVAILABLE, f"no {self.name} worker is reachable")

    def acquire(self, need: Need, cancel: Cancellation) -> Slot:
        if not self.up_workers(need.exclude):
            other = " other" if need.exclude else ""
            raise RouterError(grpc.StatusCode.UNAVAILABLE, f"no{other} {self.name} worker is reachable")
        slot = self.gate.acquire(Ticket(need.slo_class, need.priority), lambda: self._pick(need),
                                 need.max_wait_s, cancel)
        if slot is None:
            self._on_reject(self.name, need.slo_class)
            ms = self._retry_after_ms
            raise RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"every {self.name} worker is saturated; retry after {ms} ms", retry_after_ms=ms)
        return slot

    def _pick(self, need: Need) -> Slot | None:
        up = self.up_workers(need.exclude)
        if not up:  # they went down while this request waited
            raise RouterError(grpc.StatusCode.UNAVAILABLE, f"no {self.name} worker is reachable")
        chosen = choose_slot(up, self.saturation, self.policy, need.prompt_token_ids, need.num_prefill_tokens)
        if chosen is None:
            return None
        release = self.registry.reserve(self.name, chosen.address, chosen.num_reserved_tokens)
        return Slot(self.name, chosen.address, release)

