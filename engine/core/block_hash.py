"""Content hashes that name KV blocks across processes and machines.

A block's hash covers its parent's hash, its token ids and its extra keys, so equal hashes
mean equal prefixes. The root parent is a model fingerprint: blocks of different models,
dtypes or KV layouts never share a name. sha256 over a fixed byte encoding keeps the hash
stable across processes (Python's `hash()` is salted per process).

    fingerprint ─▶ h0 = H(fp, t[0:16], salt) ─▶ h1 = H(h0, t[16:32]) ─▶ h2 = H(h1, t[32:48]) ...

A request's `cache_salt` (vLLM's name; "" for none) is an extra key of its first block
only, as in vLLM: every later hash chains from that one, so requests with different salts
share no block, locally or in the kvstore, and cannot learn each other's prefixes by
asking for them. An empty salt adds nothing: unsalted hashes are what they always were.

With a names key (the platform's: services/worker/kv_seal.py) the root is the fingerprint
under that key (HMAC-SHA256), so nobody without it can compute a block's name from token
ids and ask a store whether it holds a prompt.
"""
from __future__ import annotations

import functools
import hashlib
import hmac
import json
import struct
from collections.abc import Sequence

BlockHash = bytes  # 32 raw bytes of sha256; `.hex()` on wires that want text
BLOCK_HASH_BYTES = 32  # every block hash and fingerprint is this long; anything else is not one
MAX_CACHE_SALT_CHARS = 256

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


@functools.lru_cache(maxsize=64)
def kv_layout_fingerprint(model_id: str, dtype: str, block_shape: tuple[int, ...]) -> BlockHash:
    """model_fingerprint from what a KV block's header says: its dtype name ("float32") and
    shape [num_layers, 2, block_size, num_kv_heads, head_dim]. The kvstore checks a block's
    claimed fingerprint with it; the engine's own root hash is exactly this."""
    num_layers, _, block_size, num_kv_heads, head_dim = block_shape
    return model_fingerprint(model_id, f"torch.{dtype}", num_layers, num_kv_heads, head_dim, block_size)


def keyed_root(fingerprint: BlockHash, names_key: bytes) -> BlockHash:
    """The root of the block hash chain: the fingerprint itself, or under `names_key`."""
    return hmac.digest(names_key, fingerprint, "sha256") if names_key else fingerprint


def check_cache_salt(cache_salt) -> str | None:
    """Why `cache_salt` is not a valid salt (a string of at most MAX_CACHE_SALT_CHARS), or None."""
    if not isinstance(cache_salt, str):
        return f"must be a string, got {type(cache_salt).__name__}"
    if len(cache_salt) > MAX_CACHE_SALT_CHARS:
        return f"has {len(cache_salt)} characters, at most {MAX_CACHE_SALT_CHARS}"
    try:
        cache_salt.encode()
    except UnicodeEncodeError:
        return "is not valid text (it holds a lone UTF-16 surrogate)"
    return None


def hash_block_tokens(parent: BlockHash, token_ids: Sequence[int],
                      extra_keys: Sequence[str] = ()) -> BlockHash:
    h = hashlib.sha256(parent)
    h.update(struct.pack(f"<I{len(token_ids)}I", len(token_ids), *token_ids))
    for key in extra_keys:
        encoded = key.encode()
        h.update(struct.pack("<I", len(encoded)) + encoded)
    return h.digest()


def hash_full_blocks(root: BlockHash, token_ids: Sequence[int], block_size: int,
                     start_parent: BlockHash | None = None, start_block: int = 0,
                     cache_salt: str = "") -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids` from `start_block` on, chained from
    `start_parent` (the hash of block `start_block - 1`, or the root); `cache_salt` enters
    block 0 only."""
    parent = start_parent if start_parent is not None else root
    hashes = []
    for b in range(start_block, len(token_ids) // block_size):
        extra_keys = (cache_salt,) if b == 0 and cache_salt else ()
        parent = hash_block_tokens(parent, token_ids[b * block_size:(b + 1) * block_size], extra_keys)
        hashes.append(parent)
    return hashes
