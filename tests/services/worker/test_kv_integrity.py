"""A block read from the kvstore is used only if it is the block asked for, of this
engine's layout, with its checksum intact; the first one refused ends the usable prefix."""
from __future__ import annotations

import pytest
import torch

from pdserve.engine.kv_transfer import KVLayout, KVPayload
from pdserve.services.kvstore.batch_codec import Decoded
from pdserve.services.pb import kvstore_pb2 as pb
from pdserve.services.worker import kv_integrity as integrity
from pdserve.services.worker.kv_wire import payload_from_batches, payload_to_put

LAYOUT = KVLayout.of("test-model", "float32", (2, 2, 4, 1, 8))
HASHES = [bytes([i]) * 32 for i in range(3)]


def _sealed(num_tokens: int = 3 * 4 + 2):
    blocks = torch.randn(4, *LAYOUT.block_shape, generator=torch.Generator().manual_seed(0))
    payload = KVPayload(num_tokens, blocks, HASHES)
    headers, data = payload_to_put(payload, LAYOUT, tail_key="r/tail/x")
    return payload, headers, bytes(data)


def _answer(headers, data: bytes, found=None) -> list[Decoded]:
    found = found or [True] * len(headers)
    message = pb.KVBlockBatch(headers=headers, found=found)
    return [Decoded(message, memoryview(data))]


def test_sealed_blocks_pass_and_round_trip():
    payload, headers, data = _sealed()
    read = payload_from_batches(_answer(headers, data), HASHES, LAYOUT, "r/tail/x", 2)
    assert read.refused is None and read.payload.num_tokens == 14
    assert torch.equal(read.payload.blocks, payload.blocks)


@pytest.mark.parametrize("reason,change", [
    (integrity.CHECKSUM, lambda h, d: (h, d[:LAYOUT.block_nbytes + 5] + b"\x01" + d[LAYOUT.block_nbytes + 6:])),
    (integrity.CHECKSUM, lambda h, d: (h.ClearField("checksum"), d)),
    (integrity.HASH, lambda h, d: (setattr(h, "block_hash", b"\x09" * 32), d)),
    (integrity.FINGERPRINT, lambda h, d: (setattr(h, "model_fingerprint", b"\x00" * 32), d)),
    (integrity.FINGERPRINT, lambda h, d: (setattr(h, "model_id", "other"), d)),
    (integrity.SHAPE, lambda h, d: (setattr(h, "dtype", "bfloat16"), d)),
    (integrity.SHAPE, lambda h, d: (setattr(h, "num_tokens", 3), d)),
    (integrity.SIZE, lambda h, d: (h, d[:LAYOUT.block_nbytes + 10])),
])
def test_the_first_refused_block_ends_the_prefix_with_its_reason(reason, change):
    payload, headers, data = _sealed()
    _, data = change(headers[1], data)  # the second block, in place
    read = payload_from_batches(_answer(headers, data), HASHES, LAYOUT, "r/tail/x", 2)
    assert read.refused == reason
    assert read.payload.num_tokens == 4 and torch.equal(read.payload.blocks, payload.blocks[:1])


def test_a_changed_tail_header_is_refused_even_with_the_same_bytes():
    _, headers, data = _sealed()
    headers[-1].num_tokens = 3  # the checksum covers the header: claim one more token
    read = payload_from_batches(_answer(headers, data), HASHES, LAYOUT, "r/tail/x", 3)
    assert read.refused == integrity.CHECKSUM and read.payload.num_tokens == 12


def test_a_missing_block_is_no_refusal():
    _, headers, data = _sealed()
    missing = pb.KVBlockHeader(block_hash=HASHES[1])
    read = payload_from_batches(_answer([headers[0], missing], data[:LAYOUT.block_nbytes], [True, False]),
                                HASHES[:2], LAYOUT)
    assert read.refused is None and read.payload.num_tokens == 4


def test_a_block_sealed_by_the_first_format_is_refused_as_a_checksum_mismatch():
    """v1 sealed with zlib's crc32 under its own domain string: such a block (a kvstore or a
    disk tier written before the change) fails the check and is recomputed, never used."""
    import struct
    import zlib
    payload, headers, data = _sealed()

    def v1_header_bytes(h):
        texts = (h.block_hash, h.tail_key.encode(), h.dtype.encode(), h.model_fingerprint, h.model_id.encode())
        numbers = (h.layer_start, h.layer_end, h.num_tokens, len(h.shape), *h.shape)
        return b"".join([b"pdserve-kv-block-v1"] + [struct.pack("<I", len(t)) + t for t in texts]
                        + [struct.pack(f"<{len(numbers)}I", *numbers)])
    n = LAYOUT.block_nbytes
    for i, header in enumerate(headers):
        header.checksum = zlib.crc32(data[i * n:(i + 1) * n], zlib.crc32(v1_header_bytes(header)))
    read = payload_from_batches(_answer(headers, data), HASHES, LAYOUT, "r/tail/x", 2)
    assert read.refused == integrity.CHECKSUM and read.payload is None


def test_the_checksum_reads_views_of_a_tensor_in_place():
    payload, headers, data = _sealed()
    view = memoryview(payload.blocks[1].contiguous().view(torch.uint8).numpy()).cast("B")
    assert integrity.checksum(headers[1], view) == integrity.checksum(headers[1], bytes(view)) == headers[1].checksum
