"""Starting an engine's executor: this process alone, or t x p rank processes."""
from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.engine.config import EngineConfig
from pdserve.engine.executor.base import Executor

if TYPE_CHECKING:
    import torch

    from pdserve.engine.model.loader import LoadedModel
    from pdserve.engine.model.source import ModelSource


def start_executor(config: EngineConfig, source: ModelSource, dtype: torch.dtype, loaded: LoadedModel | None,
                   progress: bool) -> Executor:
    """t x p > 1: the rank processes, and rank 0's part of the model here; else the whole
    model here (`loaded`, or loaded now)."""
    if config.parallel.world_size == 1:
        from pdserve.engine.executor.local import LocalExecutor
        from pdserve.engine.model.loader import load_model
        return LocalExecutor(loaded or load_model(source, dtype, config.device, config.scheduler.max_model_len,
                                                  progress, quantization=config.quantization))
    if loaded is not None:
        raise ValueError("loaded_model: a model already in memory is whole; with tensor or pipeline "
                         "parallelism each rank loads its own part (pass the model path instead)")
    if config.cuda_graph_batch_sizes:
        raise ValueError("cuda_graph_batch_sizes: CUDA graphs are captured for a single-rank engine only; "
                         "leave it empty with tensor_parallel_size or pipeline_parallel_size > 1")
    from pdserve.engine.executor.multiproc import MultiProcExecutor  # torch.distributed only when needed
    return MultiProcExecutor(config, source, dtype, progress)
