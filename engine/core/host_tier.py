"""The host tier: KV blocks the device cache evicted, kept by block hash in a bounded pool
of host-memory slots (vLLM's CPU offloading, Dynamo KVBM's G2 tier), from which a prefix
hit copies them back instead of recomputing them.

Pure Python, no torch, like the block pool: it decides which slot holds which hash and
which copies a step makes; the model runner moves the bytes before the step's forward
(engine/worker/host_kv_cache.py), offloads first, then onloads.

    device evicts block 7 (hash h)    offload  block 7 -> slot 2    REMOVED(DEVICE h) STORED(HOST h)
    a prefix hit on h past the        onload   slot 2 -> block 9    STORED(DEVICE h); the host
      device hits                                                   keeps h (both tiers hold it)
    host full, a new hash offloaded   the least recently used slot is reused   REMOVED(HOST old)

Why the copies need no more ordering than "offloads, then onloads, then the forward": a
device block is evicted only when it is reused, so its old bytes are read (offloaded)
before anything this step writes it (an onload, an import, the forward); a hash offloaded
and hit within one step is written to its slot before it is read back. A slot this step's
copies write or read is pinned until they have run (take_copies), so that no later
eviction in the same step hands it to another hash: a slot changes at most once a step.

LRU in O(1): an OrderedDict from hash to slot, the least recently used first; a hit or a
repeated offload moves the hash to the end. Eviction takes the first unpinned entry:
pinned ones are recent (just hit or just stored), so it looks past only those.
"""
from __future__ import annotations

from collections import OrderedDict

from pdserve.engine.core.block_hash import BlockHash
from pdserve.engine.core.cache_events import KVEventLog, KVTier

# (device block id, host slot): device -> host; (host slot, device block id): host -> device
Offload = tuple[int, int]
Onload = tuple[int, int]


class HostTier:
    def __init__(self, num_slots: int, kv_events: KVEventLog):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self.kv_events = kv_events
        self._slot_of: OrderedDict[BlockHash, int] = OrderedDict()  # least recently used first
        self._free_slots = list(range(num_slots - 1, -1, -1))  # a stack: pop() gives slot 0 first
        self._pinned: set[int] = set()
        self._offloads: list[Offload] = []
        self._onloads: list[Onload] = []
        self.num_offloaded_blocks = 0  # since start: copies device -> host
        self.num_onloaded_blocks = 0   # ...and host -> device
        self.num_evictions = 0         # hashes the tier dropped for newer ones
        self.num_dropped = 0           # offloads skipped: every slot pinned by this step's copies

    @property
    def num_used_slots(self) -> int:
        return len(self._slot_of)

    def find_run(self, block_hashes: list[BlockHash]) -> list[BlockHash]:
        """The leading hashes of `block_hashes` the tier holds (a query: nothing moves)."""
        run = []
        for block_hash in block_hashes:
            if block_hash not in self._slot_of:
                break
            run.append(block_hash)
        return run

    def offload(self, block_id: int, block_hash: BlockHash) -> None:
        """The device evicts `block_id`, cached under `block_hash`: keep its bytes. A hash
        already here needs no copy (equal hashes are equal KV); it only becomes recent."""
        if block_hash in self._slot_of:
            self._slot_of.move_to_end(block_hash)
            return
        slot = self._take_slot()
        if slot is None:
            self.num_dropped += 1
            return
        self._slot_of[block_hash] = slot
        self._pinned.add(slot)
        self._offloads.append((block_id, slot))
        self.num_offloaded_blocks += 1
        self.kv_events.stored(block_hash, KVTier.HOST)

    def pin(self, block_hashes: list[BlockHash]) -> None:
        """Hits about to be onloaded: kept (and recent) while new device blocks are taken
        for them, whose evictions offload into this tier."""
        for block_hash in block_hashes:
            self._slot_of.move_to_end(block_hash)
            self._pinned.add(self._slot_of[block_hash])

    def onload(self, block_hashes: list[BlockHash], block_ids: list[int]) -> None:
        """Copy each hash's slot into the device block beside it (pinned hashes)."""
        for block_hash, block_id in zip(block_hashes, block_ids, strict=True):
            self._onloads.append((self._slot_of[block_hash], block_id))
        self.num_onloaded_blocks += len(block_ids)

    def take_copies(self) -> tuple[list[Offload], list[Onload]]:
        """This step's copies, for the runner (which makes them before the next schedule);
        their slots are free to change again."""
        copies = self._offloads, self._onloads
        self._offloads, self._onloads = [], []
        self._pinned.clear()
        return copies

    def block_hashes(self) -> list[BlockHash]:
        """Every hash held, least recently used first."""
        return list(self._slot_of)

    def slot_of(self, block_hash: BlockHash) -> int | None:
        return self._slot_of.get(block_hash)

    def _take_slot(self) -> int | None:
        if self._free_slots:
            return self._free_slots.pop()
        victim = next((h for h, slot in self._slot_of.items() if slot not in self._pinned), None)
        if victim is None:
            return None
        self.num_evictions += 1
        self.kv_events.removed(victim, KVTier.HOST)
        return self._slot_of.pop(victim)


class NoHostTier:
    """Offloading off: nothing is kept, nothing is found, no copies."""
    num_slots = num_used_slots = 0
    num_offloaded_blocks = num_onloaded_blocks = num_evictions = num_dropped = 0

    def find_run(self, block_hashes: list[BlockHash]) -> list[BlockHash]:
        return []

    def offload(self, block_id: int, block_hash: BlockHash) -> None:
        pass

    def pin(self, block_hashes: list[BlockHash]) -> None:
        pass

    def onload(self, block_hashes: list[BlockHash], block_ids: list[int]) -> None:
        pass

    def take_copies(self) -> tuple[list[Offload], list[Onload]]:
        return [], []

    def block_hashes(self) -> list[BlockHash]:
        return []

    def slot_of(self, block_hash: BlockHash) -> int | None:
        return None
