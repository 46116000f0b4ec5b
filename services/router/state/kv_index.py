"""The router's index of which KV blocks each source holds: every worker's prefix cache
(by address) and the kvstore, fed by their KVEvents streams (kv_subscriber.py).

A block hash names its whole prefix (each hash chains its parent's, engine/core/
block_hash.py), so what a source can reuse of a prompt is the run of the prompt's
leading block hashes it holds:

    prompt     [ b0 | b1 | b2 | b3 | b4 | t ]     hashes h0..h4 (full blocks only)
    worker A     h0   h1   h2   -                -> 3 blocks, 48 tokens
    worker B     h0   -    h2                    -> 1 block (h2 without h1 is another prompt's)

The last prompt token is always computed (its logits give the first token), so a prompt
of exactly n full blocks can reuse at most n - 1 of them, as in the engine.

Memory is bounded per source: past `max_blocks_per_source` the oldest entries go (a
source never holds more than its cache, so only a misbehaving one reaches it).
"""
from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from engine.core.block_hash import hash_full_blocks
from services.router.decide.views import PrefixIndex, PrefixMatch

STORED, REMOVED = "stored", "removed"


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
        self.hashes: dict[bytes, None] = {}  # an insertion-ordered set: the oldest go first past the bound


class KVIndex(PrefixIndex):
    """Thread-safe: subscriber threads write, request threads read."""

    def __init__(self, max_blocks_per_source: int = 1 << 18):
        self.max_blocks_per_source = max_blocks_per_source
        self._lock = threading.Lock()
        self._sources: dict[str, _Source] = {}

    # ---- what the streams say --------------------------------------------------------
    def reset(self, source: str, naming: BlockNaming | None, block_hashes: Iterable[bytes] = ()) -> None:
        """A snapshot: `source` holds exactly these blocks."""
        entry = _Source(naming)
        self._add(entry, block_hashes)
        with self._lock:
            self._sources[source] = entry

    def apply(self, source: str, events: Iterable[tuple[str, Sequence[bytes]]]) -> None:
        """(STORED or REMOVED, hashes) in order; ignored for a source without a snapshot."""
        with self._lock:
            entry = self._sources.get(source)
            if entry is None:
                return
            for kind, block_hashes in events:
                if kind == STORED:
                    self._add(entry, block_hashes)
                else:
                    for h in block_hashes:
                        entry.hashes.pop(h, None)

    def drop(self, source: str) -> None:
        """The source's stream ended: what it holds is unknown until it is back."""
        with self._lock:
            self._sources.pop(source, None)

    def num_blocks(self) -> dict[str, int]:
        with self._lock:
            return {source: len(entry.hashes) for source, entry in self._sources.items()}

    # ---- what the policy asks --------------------------------------------------------
    def match(self, addresses: Sequence[str], token_ids: Sequence[int], store: str = "") -> PrefixMatch:
        """The prompt's reusable prefix on each of `addresses`, and in the kvstore `store`
        (which names blocks as the workers do: it holds what they wrote)."""
        with self._lock:
            namings = Counter(e.naming for a in addresses if (e := self._sources.get(a)) and e.naming)
        # hashing a long prompt takes a while: not under the lock the streams write under
        hashes = {naming: naming.prompt_hashes(token_ids) for naming in namings}
        common = namings.most_common(1)[0][0] if namings else None
        with self._lock:
            entries = {a: self._sources.get(a) for a in addresses}
            local = {a: _leading(e, hashes.get(e.naming)) * e.naming.block_size
                     if e is not None and e.naming is not None else 0 for a, e in entries.items()}
            store_entry = self._sources.get(store) if store else None
            in_store = _leading(store_entry, hashes.get(common)) * common.block_size if common else 0
        return PrefixMatch(local, in_store)

    def _add(self, entry: _Source, block_hashes: Iterable[bytes]) -> None:
        for h in block_hashes:
            entry.hashes[h] = None
        while len(entry.hashes) > self.max_blocks_per_source:
            del entry.hashes[next(iter(entry.hashes))]


def _leading(entry: _Source | None, hashes: list[bytes] | None) -> int:
    if entry is None or not hashes:
        return 0
    n = 0
    for h in hashes:
        if h not in entry.hashes:
            break
        n += 1
    return n
