"""Is a KV block read from the kvstore what this engine asked for? Checked before it is used.

The writer seals each block: an XXH3-64 over the header's fields (hash or tail key,
dtype, shape, layer range, tokens, model fingerprint and id) and then the block's bytes,
its low 32 bits in the header's `checksum`. The reader checks, in order, that the header names the block it asked
for, describes this engine's layout (KVLayout: model fingerprint, dtype, shape) and that
the checksum holds over the header and the bytes it received. The first block that fails
is refused with a reason (the worker counts it), and it and every block after it are
recomputed: KV is only valid after every token before it.

Why XXH3 (the `xxhash` wheel): the check is one pass over every byte a decode reads, on
its read path, and XXH3 runs at memory speed. Measured on this machine over SmolLM2's
720 KiB blocks, read in place: XXH3-64 26-32 GB/s, CRC-32C 12-15 GB/s (google-crc32c
takes only `bytes`, so a copy first), zlib's crc32 2.3-6 GB/s, blake2b 0.5 GB/s
(docs/kvstore.md). A 32-bit slice of a 64-bit hash misses a random corruption with
probability 2^-32, as crc32 did; it gives up crc32's guarantee for short bursts, which
matters on a wire without its own checks, not for bytes TCP or RDMA delivered. It catches
corruption and blocks written for another model or layout; it is not a signature: who may
write blocks at all is the kvstore's authentication.

The format is versioned by the domain string hashed first: a block sealed by another
version (v1 was zlib's crc32) fails the check as any changed block does, and is recomputed.

v3, whenever the platform has an internal token: the bytes are AES-256-GCM ciphertext and
the header's `seal` holds the nonce and the tag, over the same header fields (under v3's
domain) and the bytes (services/worker/kv_seal.py). That one is a signature: a block
written by anyone without the platform's token, or for another cache salt, is refused
(`seal`). The checksum then holds the tag's low 32 bits (the Mooncake object key names it).
"""
from __future__ import annotations

import struct

import xxhash

from pdserve.engine.kv_transfer import KVLayout
from pdserve.services.pb import kvstore_pb2
from pdserve.services.worker.kv_seal import TAG_BYTES, KVKeys, SealBroken

_DOMAIN = b"pdserve-kv-block-v2-xxh3"  # v1: zlib.crc32
_SEALED_DOMAIN = b"pdserve-kv-block-v3-aes256gcm"

# reasons a block is refused, the label of pdserve_worker_kv_blocks_rejected_total
HASH = "hash"                # the header names another block than the one asked for
FINGERPRINT = "fingerprint"  # written for another model (or dtype, or layout)
SHAPE = "shape"              # dtype, shape, layer range or token count not this engine's
SIZE = "size"                # fewer bytes arrived than the header says
CHECKSUM = "checksum"        # no checksum, or the bytes or header changed after it was taken
KVSTORE_ADDRESS = "kvstore_address"  # the handle named a kvstore this worker was not configured with
SEAL = "seal"  # not sealed with this platform's key for this request (forged, altered, or another tenant's)
REASONS = (HASH, FINGERPRINT, SHAPE, SIZE, CHECKSUM, KVSTORE_ADDRESS, SEAL)


def header_bytes(header: kvstore_pb2.KVBlockHeader, domain: bytes = _DOMAIN) -> bytes:
    """The header's fields but its checksum and seal, in one fixed encoding (protobuf's is
    not canonical across libraries): length-prefixed strings, then the integers."""
    texts = (header.block_hash, header.tail_key.encode(), header.dtype.encode(), header.model_fingerprint,
             header.model_id.encode())
    out = [domain] + [struct.pack("<I", len(t)) + t for t in texts]
    numbers = (header.layer_start, header.layer_end, header.num_tokens, len(header.shape), *header.shape)
    out.append(struct.pack(f"<{len(numbers)}I", *numbers))
    return b"".join(out)


def checksum(header: kvstore_pb2.KVBlockHeader, data) -> int:
    """The low 32 bits of XXH3-64 over the header's fields, then `data` (any contiguous
    buffer; read in place)."""
    digest = xxhash.xxh3_64(header_bytes(header))
    digest.update(data)
    return digest.intdigest() & 0xFFFFFFFF


def seal(header: kvstore_pb2.KVBlockHeader, data) -> kvstore_pb2.KVBlockHeader:
    """Sets the header's checksum over itself and `data`; returns the header."""
    header.checksum = checksum(header, data)
    return header


def seal_encrypted(header: kvstore_pb2.KVBlockHeader, data, out, keys: KVKeys,
                   cache_salt: str = "") -> kvstore_pb2.KVBlockHeader:
    """v3: encrypts `data` into `out` (as long) and sets the header's seal and checksum."""
    header.seal = keys.seal_into(header_bytes(header, _SEALED_DOMAIN), data, out, cache_salt)
    header.checksum = int.from_bytes(header.seal[-TAG_BYTES:][:4], "little")
    return header


def stamp(header: kvstore_pb2.KVBlockHeader, layout: KVLayout) -> kvstore_pb2.KVBlockHeader:
    """Names the model the block belongs to (before seal)."""
    header.model_fingerprint, header.model_id = layout.fingerprint, layout.model_id
    return header


def refusal(header: kvstore_pb2.KVBlockHeader, data, layout: KVLayout, block_hash: bytes = b"",
            tail_key: str = "", num_tokens: int = 0, keys: KVKeys | None = None, out=None,
            cache_salt: str = "") -> str | None:
    """Why the block (`header`, its bytes `data`) may not be used as the block asked for
    (`block_hash`, or `tail_key` holding `num_tokens` tokens), or None when it may. `data`
    may be longer than the block: the block is its first layout.block_nbytes bytes. With
    `keys` the block must be sealed (v3) for `cache_salt`; its plain bytes are then written
    into `out` (block_nbytes long), which is garbage when the block is refused."""
    if header.block_hash != block_hash or header.tail_key != tail_key:
        return HASH
    if header.model_fingerprint != layout.fingerprint or header.model_id != layout.model_id:
        return FINGERPRINT
    expected_tokens = num_tokens if tail_key else layout.block_size
    if (header.dtype != layout.dtype or tuple(header.shape) != layout.block_shape or header.layer_start != 0
            or header.layer_end != layout.block_shape[0] or header.num_tokens != expected_tokens):
        return SHAPE
    if len(data) < layout.block_nbytes:
        return SIZE
    if keys is not None:
        try:
            keys.open_into(header_bytes(header, _SEALED_DOMAIN), data[:layout.block_nbytes], header.seal, out,
                           cache_salt)
        except SealBroken:
            return SEAL
        return None
    if header.seal:  # sealed by a platform whose token this worker lacks: it cannot be checked
        return SEAL
    if not header.HasField("checksum") or checksum(header, data[:layout.block_nbytes]) != header.checksum:
        return CHECKSUM
    return None
