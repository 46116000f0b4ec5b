"""What a rank process is started with (JSON on its command line), and which part of the
model each rank holds: computed the same way by the driver and by the rank."""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

from pdserve.engine.config import ModelArchConfig
from pdserve.engine.executor.config import ParallelConfig
from pdserve.engine.executor.groups import RankPlace
from pdserve.engine.model.shard import ModelShard


@dataclass(frozen=True)
class RankLaunch:
    rank: int
    model: str
    dtype: str
    device: str            # the driver's; a rank on CUDA takes cuda:<rank>
    attention_backend: str
    max_model_len: int | None
    block_size: int
    parallel: ParallelConfig
    backend: str           # torch.distributed backend of the model's collectives
    master_port: int
    threads: int           # torch CPU threads of this rank
    revision: str | None = None  # the model's, from the Hugging Face cache
    quantization: str | None = None  # EngineConfig.quantization

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RankLaunch:
        fields = json.loads(text)
        parallel = dict(fields.pop("parallel"))
        if parallel["pipeline_layer_split"] is not None:
            parallel["pipeline_layer_split"] = tuple(parallel["pipeline_layer_split"])
        return cls(parallel=ParallelConfig(**parallel), **fields)

    @property
    def place(self) -> RankPlace:
        return RankPlace(self.rank, self.parallel.tensor_parallel_size, self.parallel.pipeline_parallel_size)

    @property
    def rank_device(self) -> str:
        return f"cuda:{self.rank}" if self.device.startswith("cuda") else self.device


def rank_shard(place: RankPlace, parallel: ParallelConfig, arch: ModelArchConfig) -> ModelShard:
    layers = parallel.stage_layers(arch.num_layers)[place.pp_rank]
    return ModelShard.of(arch, place.tp_rank, place.tp_size, layers, place.is_first_stage, place.is_last_stage)


def rank_kv_arch(parallel: ParallelConfig, arch: ModelArchConfig) -> ModelArchConfig:
    """The shape one rank's KV cache is sized by: its KV heads, and the most layers any
    stage has (every rank allocates the same number of blocks)."""
    shard = rank_shard(RankPlace(0, parallel.tensor_parallel_size, parallel.pipeline_parallel_size), parallel, arch)
    most_layers = max(len(r) for r in parallel.stage_layers(arch.num_layers))
    return dataclasses.replace(arch, num_layers=most_layers, num_kv_heads=len(shard.kv_heads))


def threads_per_rank(world_size: int) -> int:
    """The cores this process may use, shared out between the ranks."""
    return max(1, len(os.sched_getaffinity(0)) // world_size)
