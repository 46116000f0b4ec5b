"""The single-rank executor: the whole model and its KV cache in this process."""
from __future__ import annotations

import torch

from pdserve.engine.attention.backend import AttentionBackend
from pdserve.engine.executor.base import Executor
from pdserve.engine.model.loader import LoadedModel
from pdserve.engine.worker.host_kv_cache import HostKVCache, NoHostKVCache, host_kv_cache
from pdserve.engine.worker.kv_cache import export_blocks, import_blocks
from pdserve.engine.worker.step_batch import StepInputs


class LocalExecutor(Executor):
    def __init__(self, loaded: LoadedModel):
        self.loaded = loaded
        self.kv_arch = loaded.arch
        self.kv_caches: list[torch.Tensor] = []
        self.backend: AttentionBackend | None = None  # these set by start_kv
        self.host_kv: HostKVCache | NoHostKVCache = NoHostKVCache()

    def start_kv(self, num_blocks: int, kv_caches: list[torch.Tensor], backend: AttentionBackend,
                 num_host_slots: int = 0) -> None:
        self.kv_caches, self.backend = kv_caches, backend
        self.host_kv = host_kv_cache(kv_caches, num_host_slots)

    def forward(self, batches: list[StepInputs]) -> torch.Tensor:
        (batch,) = batches  # no pipeline: one micro-batch per step
        return self.loaded.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta, self.backend,
                                 batch.logits_indices)

    def import_blocks(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        import_blocks(self.kv_caches, block_ids, blocks)

    def export_blocks(self, block_ids: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
        return export_blocks(self.kv_caches, block_ids, out)

    def copy_host_blocks(self, offloads: list[tuple[int, int]], onloads: list[tuple[int, int]]) -> None:
        self.host_kv.copy(offloads, onloads)
