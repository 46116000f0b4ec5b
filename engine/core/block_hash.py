"""Content hashes that name KV blocks across processes and machines.

A block's hash covers its parent's hash, its token ids and its extra keys, so equal hashes
mean equal prefixes. The root parent is a model fingerprint: blocks of different models,
dtypes or KV layouts never share a name. sha256 over a fixed byte encoding keeps the hash
stable across processes (Python's `hash()` is salted per process).

    fingerprint ─▶ h0 = H(fp, t[0:16]) ─▶ h1 = H(h0, t[16:32]) ─▶ h2 = H(h1, t[32:48]) ...
"""
from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence

BlockHash = bytes  # 32 raw bytes of sha256; `.hex()` on wires that want text

_VERSION = b"pdserve-kv-v1"


def model_fingerprint(model_id: str, dtype: str, num_layers: int, num_kv_heads: int,
                      head_dim: int, block_size: int, tp_rank: int = 0,
                      tp_size: int = 1) -> BlockHash:
    """The root parent hash: everything that makes one KV block's bytes differ from another's."""
    desc = {"model_id": model_id, "dtype": dtype, "num_layers": num_layers,
            "num_kv_heads": num_kv_heads, "head_dim": head_dim, "block_size": block_size,
            "tp_rank": tp_rank, "tp_size": tp_size}
    payload = json.dumps(desc, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(_VERSION + payload).digest()


def hash_block_tokens(parent: BlockHash, token_ids: Sequence[int],
                      extra_keys: Sequence[str] = ()) -> BlockHash:
    h = hashlib.sha256(parent)
    h.update(struct.pack(f"<I{len(token_ids)}I", len(token_ids), *token_ids))
    for key in extra_keys:
        encoded = key.encode()
        h.update(struct.pack("<I", len(encoded)) + encoded)
    return h.digest()


def hash_full_blocks(root: BlockHash, token_ids: Sequence[int], block_size: int,
                     start_parent: BlockHash | None = None, start_block: int = 0) -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids` from `start_block` on, chained from
    `start_parent` (the hash of block `start_block - 1`, or the root)."""
    parent = start_parent if start_parent is not None else root
    hashes = []
    for b in range(start_block, len(token_ids) // block_size):
        parent = hash_block_tokens(parent, token_ids[b * block_size:(b + 1) * block_size])
        hashes.append(parent)
    return hashes
