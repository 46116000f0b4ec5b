"""The torch.distributed groups of one rank of a t x p engine.

Rank numbering: rank = pp_rank * t + tp_rank, so a pipeline stage's t ranks are
consecutive and rank 0 (the driver, which runs the scheduler) is stage 0's first rank.

Two kinds of traffic, two groups:
- the model's collectives (all-reduce, all-gather within a stage, activations from stage
  to stage, logits back to the driver): `device`, nccl on GPUs, gloo on CPU;
- the step's inputs and KV blocks the driver sends: `cpu`, always gloo (they start on the host).
Every collective of both fails after the configured timeout.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist


# how long the ranks may take to start and meet (process start, imports), collectives aside
START_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class RankPlace:
    rank: int
    tp_size: int
    pp_size: int

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def peer(self, pp_rank: int, tp_rank: int | None = None) -> int:
        """The global rank at (stage, tp rank); the same tp rank as this one by default."""
        return pp_rank * self.tp_size + (self.tp_rank if tp_rank is None else tp_rank)


class ParallelGroups:
    """Joins the rendezvous and builds the groups; `tp` is what the model calls."""

    def __init__(self, place: RankPlace, backend: str, master_port: int, timeout_s: float):
        self.place = place
        timeout = datetime.timedelta(seconds=timeout_s)
        # joining waits for processes still importing torch (slow on a busy host): its own, longer limit
        store = dist.TCPStore("127.0.0.1", master_port, place.world_size, is_master=place.rank == 0,
                              timeout=datetime.timedelta(seconds=max(timeout_s, START_TIMEOUT_S)))
        dist.init_process_group(backend=backend, store=store, rank=place.rank, world_size=place.world_size,
                                timeout=timeout)
        self.device = dist.group.WORLD
        self.cpu = self.device if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
        self.tp_group = None
        for stage in range(place.pp_size):  # every rank creates every group, in the same order
            group = dist.new_group([place.peer(stage, t) for t in range(place.tp_size)], timeout=timeout)
            if stage == place.pp_rank:
                self.tp_group = group
        self.tp = TensorParallelOps(self.tp_group, place.tp_size)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class TensorParallelOps:
    """The two collectives a tensor-parallel model makes (engine/model/llama.py)."""

    def __init__(self, group, size: int):
        self.group, self.size = group, size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)
