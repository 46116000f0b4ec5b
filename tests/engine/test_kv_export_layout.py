"""export_blocks / import_blocks (engine/worker/kv_cache.py): the paged caches' blocks out
into one contiguous tensor in the wire layout, and back, exactly."""
from __future__ import annotations

import pytest
import torch

from pdserve.engine.kv_transfer import BlockChunks, as_tensor
from pdserve.engine.worker.kv_cache import export_blocks, import_blocks


def reference_export(caches: list[torch.Tensor], block_ids: list[int]) -> torch.Tensor:
    """[n, layers, 2, bs, h, d], built the obvious way."""
    return torch.stack([torch.stack([c[:, b] for c in caches]) for b in block_ids])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_export_is_the_wire_layout_contiguous_and_exact(dtype):
    gen = torch.Generator().manual_seed(0)
    caches = [torch.randn((2, 9, 4, 3, 8), generator=gen).to(dtype) for _ in range(5)]
    block_ids = [7, 0, 3, 3]
    out = export_blocks(caches, block_ids)
    assert out.is_contiguous() and out.device.type == "cpu" and out.dtype == dtype
    assert torch.equal(out, reference_export(caches, block_ids))


def test_import_puts_exported_blocks_back_in_other_slots():
    gen = torch.Generator().manual_seed(1)
    source = [torch.randn((2, 6, 4, 2, 8), generator=gen) for _ in range(3)]
    target = [torch.zeros_like(c) for c in source]
    import_blocks(target, [5, 1], export_blocks(source, [2, 4]))
    for s, t in zip(source, target):
        assert torch.equal(t[:, 5], s[:, 2]) and torch.equal(t[:, 1], s[:, 4])
        assert t[:, [0, 2, 3, 4]].abs().sum() == 0


def test_import_from_chunks_writes_each_chunk_to_its_blocks_without_joining_them(monkeypatch):
    gen = torch.Generator().manual_seed(2)
    source = [torch.randn((2, 8, 4, 2, 8), generator=gen) for _ in range(3)]
    exported = export_blocks(source, [6, 2, 0, 5, 1])
    chunks = BlockChunks([exported[:2], exported[2:3], exported[3:]])
    target = [torch.zeros_like(c) for c in source]
    monkeypatch.setattr(torch, "cat", lambda *a, **k: pytest.fail("the chunks were joined"))
    import_blocks(target, [1, 3, 4, 7, 0], chunks)
    for s, t in zip(source, target):
        for dst, src in zip([1, 3, 4, 7, 0], [6, 2, 0, 5, 1]):
            assert torch.equal(t[:, dst], s[:, src])
        assert t[:, [2, 5, 6]].abs().sum() == 0


def test_block_chunks_read_as_the_joined_tensor():
    whole = torch.arange(7 * 2 * 3, dtype=torch.float32).reshape(7, 2, 3)
    chunks = BlockChunks([whole[:3], whole[3:3], whole[3:4], whole[4:]])  # an empty chunk is dropped
    assert chunks.shape == whole.shape and chunks.dtype == whole.dtype and len(chunks) == 7
    assert [offset for offset, _ in chunks.pieces()] == [0, 3, 4]
    assert torch.equal(as_tensor(chunks), whole)
    for start, stop in ((0, 7), (1, 6), (3, 4), (2, 5), (4, 7), (5, None)):
        assert torch.equal(as_tensor(chunks[start:stop]), whole[start:stop]), (start, stop)
    with pytest.raises(TypeError, match="slices of whole blocks"):
        chunks[::2]
    with pytest.raises(TypeError, match="slices of whole blocks"):
        chunks[1]
    with pytest.raises(ValueError, match="empty"):
        chunks[7:]
    with pytest.raises(ValueError, match="beside"):
        BlockChunks([whole[:2], whole[2:].double()])
