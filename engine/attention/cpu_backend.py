"""The default CPU backend: decodes through the C++ kernel in kernels/cpu, which reads each
sequence's K/V rows in place through its block table, up to its own length. So unlike the
torch backend there is no gather to copy and no length grouping to bound it: the whole
decode batch is one call. Cache writes and prefills are the torch backend's.
"""
from __future__ import annotations

import torch

from pdserve.engine.attention.backend import AttentionMetadata
from pdserve.engine.attention.torch_backend import TorchAttentionBackend
from pdserve.kernels.cpu import paged_decode_attention
from pdserve.kernels.cpu.build import load_library


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self):
        super().__init__()
        load_library()  # build or load now: a missing compiler fails at engine start, not mid-step

    def _decode_batch(self, query, key_cache, value_cache, meta: AttentionMetadata, scale: float,
                      out: torch.Tensor, window: int | None, softcap: float | None) -> None:
        nd = meta.num_decodes
        paged_decode_attention(query, key_cache, value_cache, meta.block_tables[:nd], meta.seq_lens[:nd],
                               scale, out=out, window=window, softcap=softcap)
