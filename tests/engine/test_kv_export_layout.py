"""export_blocks / import_blocks (engine/worker/kv_cache.py): the paged caches' blocks out
into one contiguous tensor in the wire layout, and back, exactly."""
from __future__ import annotations

import pytest
import torch

from engine.worker.kv_cache import export_blocks, import_blocks


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
