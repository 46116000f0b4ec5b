"""How one engine spreads over processes: tensor parallelism (TP) within a stage, pipeline
parallelism (PP) across stages. t x p ranks, one process each (engine/executor/)."""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.errors import InvalidRequestError


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # layers per pipeline stage, e.g. (20, 12); None: an even split, the first stages
    # taking one more layer when the count does not divide
    pipeline_layer_split: tuple[int, ...] | None = None
    # a step's requests are split into this many micro-batches, so that the stages of a
    # pipeline work on different ones at once; None: one per stage
    pipeline_microbatches: int | None = None
    # every collective (and the start-up rendezvous) fails after this long: a dead or
    # hung rank stops the engine with an error instead of a hang
    collective_timeout_s: float = 60.0
    # torch.distributed backend for the model's collectives; None: nccl on CUDA, gloo on CPU
    distributed_backend: str | None = None

    def __post_init__(self):
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidRequestError(name, f"must be an integer >= 1, got {value!r}")
        split = self.pipeline_layer_split
        if split is not None:
            if (not isinstance(split, tuple) or len(split) != self.pipeline_parallel_size
                    or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in split)):
                raise InvalidRequestError("pipeline_layer_split", f"must give a layer count >= 1 for each of the "
                                          f"{self.pipeline_parallel_size} pipeline stages, got {split!r}")
        mb = self.pipeline_microbatches
        if mb is not None and (isinstance(mb, bool) or not isinstance(mb, int) or mb < 1):
            raise InvalidRequestError("pipeline_microbatches", f"must be an integer >= 1 or None, got {mb!r}")
        if not self.collective_timeout_s > 0:
            raise InvalidRequestError("collective_timeout_s", f"must be > 0, got {self.collective_timeout_s!r}")
        if self.distributed_backend not in (None, "gloo", "nccl"):
            raise InvalidRequestError("distributed_backend", f"must be 'gloo', 'nccl' or None (auto), "
                                      f"got {self.distributed_backend!r}")

    @property
    def num_microbatches(self) -> int:
        return self.pipeline_microbatches or self.pipeline_parallel_size

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def stage_layers(self, num_layers: int) -> list[range]:
        """The model's layers each pipeline stage runs, in order."""
        p = self.pipeline_parallel_size
        if self.pipeline_layer_split is not None:
            counts = list(self.pipeline_layer_split)
            if sum(counts) != num_layers:
                raise InvalidRequestError("pipeline_layer_split", f"{counts} adds up to {sum(counts)} layers; "
                                          f"the model has {num_layers}")
        else:
            if p > num_layers:
                raise InvalidRequestError("pipeline_parallel_size", f"{p} stages for a model of {num_layers} layers")
            counts = [num_layers // p + (1 if s < num_layers % p else 0) for s in range(p)]
        starts = [sum(counts[:s]) for s in range(p)]
        return [range(start, start + n) for start, n in zip(starts, counts)]
