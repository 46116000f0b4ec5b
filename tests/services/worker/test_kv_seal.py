"""Blocks sealed with the platform's key (services/worker/kv_seal.py): what goes on the
wire is ciphertext, a reader with the key and the request's salt gets the exact block
back, and every block it cannot verify is refused as `seal`: forged under any key a
process without the token can compute, altered, moved, another tenant's, or unsealed."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pdserve.engine.core.block_hash import hash_full_blocks, keyed_root
from pdserve.engine.kv_transfer import KVLayout, KVPayload
from pdserve.services.kvstore.batch_codec import Decoded
from pdserve.services.pb import kvstore_pb2 as pb
from pdserve.services.worker import kv_integrity as integrity
from pdserve.services.worker.kv_seal import SEAL_BYTES, KVKeys
from pdserve.services.worker.kv_wire import payload_from_batches, payload_to_put

LAYOUT = KVLayout.of("test-model", "float32", (2, 2, 4, 1, 8))
HASHES = [bytes([i]) * 32 for i in range(3)]
KEYS = KVKeys.from_token("the-platform-token")
TAIL = "r/tail/x"


def _payload() -> KVPayload:
    blocks = torch.randn(4, *LAYOUT.block_shape, generator=torch.Generator().manual_seed(0))
    return KVPayload(3 * 4 + 2, blocks, HASHES)


def _answer(headers, data) -> list[Decoded]:
    return [Decoded(pb.KVBlockBatch(headers=headers, found=[True] * len(headers)), memoryview(bytes(data)))]


def _read(headers, data, keys=KEYS, salt="tenant-a"):
    return payload_from_batches(_answer(headers, data), HASHES, LAYOUT, TAIL, 2, keys=keys, cache_salt=salt)


def _put(payload=None, keys=KEYS, salt="tenant-a"):
    headers, data = payload_to_put(payload or _payload(), LAYOUT, tail_key=TAIL, keys=keys, cache_salt=salt)
    return headers, bytes(data)


def test_a_sealed_payload_round_trips_exactly_and_the_wire_holds_no_plain_row():
    payload = _payload()
    headers, data = _put(payload)
    assert all(len(h.seal) == SEAL_BYTES for h in headers)
    read = _read(headers, data)
    assert read.refused is None and read.payload.num_tokens == 14
    assert torch.equal(read.payload.blocks, payload.blocks)
    plain = payload.blocks.numpy().view(np.uint8).reshape(len(payload.blocks), -1)
    # no 32-byte run of any block (one head's K or V row) is on the wire
    for row in plain:
        for start in range(0, len(row), 32):
            assert bytes(row[start:start + 32]) not in data


def test_two_writes_of_one_block_differ_on_the_wire():
    """A key per block write: equal blocks never give equal ciphertext (no repeated GCM nonce)."""
    first, second = _put()[1], _put()[1]
    assert first != second


@pytest.mark.parametrize("reader_keys, salt", [(KVKeys.from_token("another-platform"), "tenant-a"),
                                               (KEYS, "tenant-b"), (KEYS, "")])
def test_another_platform_or_tenant_cannot_open_a_block(reader_keys, salt):
    headers, data = _put()
    read = _read(headers, data, reader_keys, salt)
    assert read.refused == integrity.SEAL and read.payload is None


def test_a_block_forged_with_the_unkeyed_checksum_is_refused_and_would_pass_without_the_key():
    """What a forger without the token can compute: a v2 block (XXH3 over public fields).
    The control shows the same bytes are accepted by a reader without keys."""
    headers, data = _put(keys=None)
    assert _read(headers, data, keys=None).refused is None  # the control: no key, the forgery passes
    read = _read(headers, data)
    assert read.refused == integrity.SEAL and read.payload is None


def test_a_sealed_block_is_refused_by_a_reader_without_the_key():
    headers, data = _put()
    assert _read(headers, data, keys=None).refused == integrity.SEAL


@pytest.mark.parametrize("change", ["byte", "tag", "nonce", "num_tokens", "model_id", "swap"])
def test_an_altered_or_moved_block_is_refused(change):
    headers, data = _put()
    data = bytearray(data)
    n = LAYOUT.block_nbytes
    if change == "byte":
        data[n + 5] ^= 1
    elif change == "tag":
        headers[1].seal = headers[1].seal[:-1] + bytes([headers[1].seal[-1] ^ 1])
    elif change == "nonce":
        headers[1].seal = bytes([headers[1].seal[0] ^ 1]) + headers[1].seal[1:]
    elif change == "num_tokens":  # the tail claimed as 3 tokens, its seal kept
        headers[3].num_tokens = 3
    elif change == "model_id":
        headers[1].model_id = "other"
    else:  # block 2's header and bytes served as block 1's, its name rewritten
        data[n:2 * n] = data[2 * n:3 * n]
        headers[2].block_hash = HASHES[1]
        headers[1] = headers[2]
    read = payload_from_batches(_answer(headers, data), HASHES, LAYOUT, TAIL, 3 if change == "num_tokens" else 2,
                                keys=KEYS, cache_salt="tenant-a")
    expected_used = 3 if change == "num_tokens" else 1
    assert read.refused in (integrity.SEAL, integrity.FINGERPRINT)
    assert read.refused == (integrity.FINGERPRINT if change == "model_id" else integrity.SEAL)
    assert read.payload.num_tokens == expected_used * LAYOUT.block_size


def test_the_names_key_changes_every_block_name():
    tokens = list(range(40))
    public = hash_full_blocks(LAYOUT.fingerprint, tokens, 4)
    keyed = hash_full_blocks(keyed_root(LAYOUT.fingerprint, KEYS.names_key), tokens, 4)
    other = hash_full_blocks(keyed_root(LAYOUT.fingerprint, KVKeys.from_token("x").names_key), tokens, 4)
    assert not set(public) & set(keyed) and not set(keyed) & set(other)
    assert keyed_root(LAYOUT.fingerprint, b"") == LAYOUT.fingerprint


def test_no_token_no_keys_and_keys_are_never_printed():
    assert KVKeys.from_token(None) is None and KVKeys.from_token("") is None
    assert KEYS.seal_key.hex() not in repr(KEYS) and KEYS.names_key.hex() not in repr(KEYS)
