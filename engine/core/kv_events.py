"""What the prefix cache gained and lost, for whoever places requests by it (a router).

The block pool appends one event per change: STORED when a full block is registered
under its hash, REMOVED when a cached block is evicted (its slot reused). The buffer is
bounded: when nobody drains it (an offline LLM) or a drain comes too late, it stops
recording and says so (`lost`), and the drainer takes a snapshot of the whole cache
instead. Appends are a tuple into a list: cheap enough to be always on.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from engine.core.block_hash import BlockHash


class KVEventKind(Enum):
    STORED = "stored"
    REMOVED = "removed"


@dataclass(frozen=True)
class KVEvents:
    """Changes in order since the last drain. `snapshot` (when not None) is every hash
    the cache holds now and replaces all that came before: events were lost."""
    events: list[tuple[KVEventKind, BlockHash]] = field(default_factory=list)
    snapshot: list[BlockHash] | None = None

    @property
    def is_empty(self) -> bool:
        return not self.events and self.snapshot is None


class KVEventLog:
    def __init__(self, max_events: int = 65536):
        self.max_events = max_events
        self._events: list[tuple[KVEventKind, BlockHash]] = []
        self.lost = False

    def stored(self, block_hash: BlockHash) -> None:
        self._append(KVEventKind.STORED, block_hash)

    def removed(self, block_hash: BlockHash) -> None:
        self._append(KVEventKind.REMOVED, block_hash)

    def _append(self, kind: KVEventKind, block_hash: BlockHash) -> None:
        if self.lost:
            return
        if len(self._events) >= self.max_events:  # the drainer resyncs from a snapshot
            self._events.clear()
            self.lost = True
            return
        self._events.append((kind, block_hash))

    def drain(self) -> tuple[list[tuple[KVEventKind, BlockHash]], bool]:
        """The events since the last drain and whether some were lost; empties the log."""
        events, lost = self._events, self.lost
        self._events, self.lost = [], False
        return events, lost
