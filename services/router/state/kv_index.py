"""The router's index of which KV blocks each source holds: every worker's prefix cache
(by address) and the kvstore, fed by their KVEvents streams (kv_subscriber.py).

A block hash names its whole prefix (each hash chains its parent's, engine/core/
block_hash.py), so what a source can reuse of a prompt is the run of the prompt's
leading block hashes it holds:

    prompt     [ b0 | b1 | b2 | b3 | b4 | t ]     hashes h0..h4 (full blocks only)
    worker A     h0   h1   h2   -                -> 3 blocks, 48 tokens
    worker B     h0   -    h2                    -> 1 block (h2 without h1 is another prompt's)

A worker holds blocks in tiers, each kept apart here: DEVICE (its KV cache) and HOST
(host memory the device evicted to). Its engine reuses the device run, then copies back
the host run that continues it, then computes the rest; so does the match:

    prompt     [ b0 | b1 | b2 | b3 | b4 | t ]
    worker C     D    D    H    H    -          -> device 2 blocks, host 2 blocks after them
    worker D     H    D    D                    -> device 0, host 1 (b1, b2 on device are
                                                   past a block the host run does not hold)

The kvstore's blocks are all in its own (default) tier; its run counts from b0, whatever
the workers hold. The last prompt token is always computed (its logits give the first
token), so a prompt of exactly n full blocks can reuse at most n - 1 of them, as in the
engine.

Memory is bounded per source and tier: past `max_blocks_per_source` the oldest entries go
(a source never holds more than its cache, so only a misbehaving one reaches it).
"""
from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pdserve.engine.core.block_hash import hash_full_blocks
from pdserve.services.router.decide.views import PrefixIndex, PrefixMatch

STORED, REMOVED = "stored", "removed"
DEVICE, HOST = "device", "host"  # a worker's tiers; the kvstore reports its blocks as DEVICE (its own)

# (STORED or REMOVED, block hashes, tier): what the streams say, in order
IndexEvent = tuple[str, Sequence[bytes], str]


@dataclass(frozen=True)
class BlockNaming:
    """How a source names blocks: its block size and model fingerprint (root hash)."""
    block_size: int
    root_hash: bytes

    def prompt_hashes(self, token_ids: Sequence[int]) -> list[bytes]:
        """The hashes of the prompt's reusable full blocks (all but the last token's)."""
        num_tokens = max(len(token_ids) - 1, 0) // self.block_size * self.block_size
        return hash_full_blocks(self.root_hash, token_ids[:num_tokens], self.block_size)


class _Source:
    def __init__(self, naming: BlockNaming | None):
        self.naming = naming
        # by tier, an insertion-ordered set each: the oldest go first past the bound
        self.tiers: dict[str, dict[bytes, None]] = {}

    def leading(self, hashes: Sequence[bytes], tier: str, start: int = 0) -> int:
        """How many of `hashes` from `start` on this tier holds, in a run."""
        held = self.tiers.get(tier, {})
        n = start
        while n < len(hashes) and hashes[n] in held:
            n += 1
        return n - start

    def leading_any(self, hashes: Sequence[bytes]) -> int:
        """The run from the first hash held in any tier (the kvstore's)."""
        n = 0
        while n < len(hashes) and any(hashes[n] in held for held in self.tiers.values()):
            n += 1
        return n


class KVIndex(PrefixIndex):
    """Thread-safe: subscriber threads write, request threads read."""

    def __init__(self, max_blocks_per_source: int = 1 << 18):
        self.max_blocks_per_source = max_blocks_per_source
        self._lock = threading.Lock()
        self._sources: dict[str, _Source] = {}

    # ---- what the streams say --------------------------------------------------------
    def reset(self, source: str, naming: BlockNaming | None, held: Iterable[IndexEvent] = ()) -> None:
        """A snapshot: `source` holds exactly what `held` (STORED events, a tier each) stores."""
        entry = _Source(naming)
        self._apply(entry, held)
        with self._lock:
            self._sources[source] = entry

    def apply(self, source: str, events: Iterable[IndexEvent]) -> None:
        """(STORED or REMOVED, hashes, tier) in order; ignored for a source without a snapshot."""
        with self._lock:
            entry = self._sources.get(source)
            if entry is not None:
                self._apply(entry, events)

    def drop(self, source: str) -> None:
        """The source's stream ended: what it holds is unknown until it is back."""
        with self._lock:
            self._sources.pop(source, None)

    def num_blocks(self) -> dict[str, int]:
        """Blocks held by source, all tiers together."""
        return {source: sum(by_tier.values()) for source, by_tier in self.num_blocks_by_tier().items()}

    def num_blocks_by_tier(self) -> dict[str, dict[str, int]]:
        """Blocks held by source, then tier."""
        with self._lock:
            return {source: {tier: len(held) for tier, held in entry.tiers.items()}
                    for source, entry in self._sources.items()}

    # ---- what the policy asks --------------------------------------------------------
    def match(self, addresses: Sequence[str], token_ids: Sequence[int], store: str = "") -> PrefixMatch:
        """The prompt's reusable prefix on each of `addresses` (in its device cache, then
        in host memory after that), and in the kvstore `store` (which names blocks as the
        workers do: it holds what they wrote)."""
        with self._lock:
            namings = Counter(e.naming for a in addresses if (e := self._sources.get(a)) and e.naming)
        # hashing a long prompt takes a while: not under the lock the streams write under
        hashes = {naming: naming.prompt_hashes(token_ids) for naming in namings}
        common = namings.most_common(1)[0][0] if namings else None
        device, host = {}, {}
        with self._lock:
            for a in addresses:
                device[a], host[a] = _worker_run(self._sources.get(a), hashes)
            store_entry = self._sources.get(store) if store else None
            in_store = store_entry.leading_any(hashes[common]) * common.block_size if store_entry and common else 0
        return PrefixMatch(device, in_store, host)

    def _apply(self, entry: _Source, events: Iterable[IndexEvent]) -> None:
        for kind, block_hashes, tier in events:
            held = entry.tiers.setdefault(tier, {})
            if kind == STORED:
                for h in block_hashes:
                    held[h] = None
                while len(held) > self.max_blocks_per_source:
                    del held[next(iter(held))]
            else:
                for h in block_hashes:
                    held.pop(h, None)


def _worker_run(entry: _Source | None, hashes: dict[BlockNaming, list[bytes]]) -> tuple[int, int]:
    """(device tokens, host tokens after them) of the prompt's leading run on one worker."""
    if entry is None or entry.naming is None:
        return 0, 0
    prompt = hashes[entry.naming]
    num_device = entry.leading(prompt, DEVICE)
    num_host = entry.leading(prompt, HOST, start=num_device)
    return num_device * entry.naming.block_size, num_host * entry.naming.block_size
