"""The executor contract: where an engine's model runs (one process, or t x p ranks).

Every engine has one, so no caller asks whether there is an executor. The engine core
starts it, sizes the KV cache from `kv_arch`, and stops it; the model runner gets it
handed in and calls `forward` and the KV copies, knowing nothing of ranks:

    EngineCore ──start_kv / check_health / shutdown──▶ Executor
    ModelRunner ─forward / import_blocks / export_blocks / copy_host_blocks─▶ Executor
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from pdserve.engine.attention.backend import AttentionBackend
    from pdserve.engine.config import ModelArchConfig
    from pdserve.engine.model.loader import LoadedModel
    from pdserve.engine.worker.step_batch import StepInputs


class Executor(ABC):
    # this process's part of the model (on one rank: all of it); arch and tokenizer are whole
    loaded: LoadedModel
    kv_arch: ModelArchConfig       # the layers and KV heads whose cache this process holds
    num_microbatches: int = 1      # the pipeline's micro-batches per step (1: no pipeline)
    holds_whole_model: bool = True  # False where `loaded` is one rank's shard

    @abstractmethod
    def start_kv(self, num_blocks: int, kv_caches: list[torch.Tensor], backend: AttentionBackend,
                 num_host_slots: int = 0) -> None:
        """Every rank allocates `num_blocks` KV blocks, this process's being `kv_caches`, and
        a host buffer of `num_host_slots` blocks of its part (engine/worker/host_kv_cache.py)."""

    @abstractmethod
    def forward(self, batches: list[StepInputs]) -> torch.Tensor:
        """The logits at each micro-batch's logits_indices, concatenated in order."""

    @abstractmethod
    def import_blocks(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        """Whole blocks (every layer and KV head) into the cache; each rank keeps its part."""

    @abstractmethod
    def export_blocks(self, block_ids: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """Whole blocks out of the cache, gathered from the ranks that hold them, into
        `out` (host memory of their shape and dtype) when given."""

    @abstractmethod
    def copy_host_blocks(self, offloads: list[tuple[int, int]], onloads: list[tuple[int, int]]) -> None:
        """The host tier's copies, on every rank for its part: (device block, host slot)
        out of the cache first, then (host slot, device block) into it."""

    def check_health(self) -> None:
        """Raises EngineDeadError once a rank has died; one process has none to lose."""

    def shutdown(self) -> None:
        """Stops the rank processes; one process has none to stop."""
