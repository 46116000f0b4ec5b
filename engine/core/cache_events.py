"""What the prefix cache gained and lost, for whoever places requests by it (a router).

The engine appends one event per change, naming the tier that changed: STORED when a full
block is registered under its hash, REMOVED when a cached block is evicted (its slot
reused). DEVICE is the KV cache the model reads; HOST is the bounded host-memory tier that
keeps blocks the device cache evicted (engine/core/host_tier.py), from which a prefix hit
copies them back. A block moving device -> host is REMOVED(DEVICE) then STORED(HOST).

The buffer is bounded: when nobody drains it (an offline LLM) or a drain comes too late,
it stops recording and says so (`lost`), and the drainer takes a snapshot of every tier
instead. Appends are a tuple into a list: cheap enough to be always on.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from pdserve.engine.core.block_hash import BlockHash


class KVEventKind(Enum):
    STORED = "stored"
    REMOVED = "removed"


class KVTier(Enum):
    DEVICE = "device"  # the engine's KV cache: a hit costs nothing
    HOST = "host"      # host memory beside it: a hit costs a copy back


KVEvent = tuple[KVEventKind, BlockHash, KVTier]


@dataclass(frozen=True)
class KVEvents:
    """Changes in order since the last drain. `snapshot` (when not None) is every
    (hash, tier) the engine holds now and replaces all that came before: events were lost."""
    events: list[KVEvent] = field(default_factory=list)
    snapshot: list[tuple[BlockHash, KVTier]] | None = None

    @property
    def is_empty(self) -> bool:
        return not self.events and self.snapshot is None


class KVEventLog:
    def __init__(self, max_events: int = 65536):
        self.max_events = max_events
        self._events: list[KVEvent] = []
        self.lost = False

    def stored(self, block_hash: BlockHash, tier: KVTier = KVTier.DEVICE) -> None:
        self._append((KVEventKind.STORED, block_hash, tier))

    def removed(self, block_hash: BlockHash, tier: KVTier = KVTier.DEVICE) -> None:
        self._append((KVEventKind.REMOVED, block_hash, tier))

    def _append(self, event: KVEvent) -> None:
        if self.lost:
            return
        if len(self._events) >= self.max_events:  # the drainer resyncs from a snapshot
            self._events.clear()
            self.lost = True
            return
        self._events.append(event)

    def drain(self) -> tuple[list[KVEvent], bool]:
        """The events since the last drain and whether some were lost; empties the log."""
        events, lost = self._events, self.lost
        self._events, self.lost = [], False
        return events, lost
