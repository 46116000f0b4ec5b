"""The torch.distributed groups of one rank of a t x p engine.

Rank numbering: rank = pp_rank * t + tp_rank, so a pipeline stage's t ranks are
consecutive and rank 0 (the driver, which runs the scheduler) is stage 0's first rank.

Three groups, by traffic:
- the model's all-reduce and all-gather within a stage: `tp`, the stage's t ranks;
- activations from stage to stage, logits back to the driver: `device`, every rank;
  these two use nccl on GPUs, gloo on CPU;
- the step's inputs and KV blocks the driver sends: `cpu`, every rank, always gloo (they
  start on the host).
Every collective of each fails after the configured timeout.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pdserve.engine.executor.rank_group import RankGroup


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
    """Joins the engine's rendezvous and builds its groups; `tp` is what the model calls.

    The store is the engine's own (its port chosen by the driver) and the groups are built
    on it directly, outside torch.distributed's one default group per process: engines
    side by side in one driver each hold their own (engine/executor/rank_group.py)."""

    def __init__(self, place: RankPlace, backend: str, master_port: int, timeout_s: float):
        self.place = place
        timeout = datetime.timedelta(seconds=timeout_s)
        # joining waits for processes still importing torch (slow on a busy host): its own, longer limit
        self._store = dist.TCPStore("127.0.0.1", master_port, place.world_size, is_master=place.rank == 0,
                                    timeout=datetime.timedelta(seconds=max(timeout_s, START_TIMEOUT_S)))
        self.device = RankGroup.open(self._store, "device", place.rank, place.world_size, backend, timeout)
        self.cpu = self.device if backend == "gloo" else RankGroup.open(
            self._store, "cpu", place.rank, place.world_size, "gloo", timeout)
        # only a stage's own ranks join its group: its ranks there are the tp ranks
        stage_ranks = RankGroup.open(self._store, f"tp{place.pp_rank}", place.tp_rank, place.tp_size, backend, timeout)
        self.tp = TensorParallelOps(stage_ranks)
        self._groups = [self.device, self.cpu, stage_ranks]

    def close(self) -> None:
        for group in {id(g): g for g in self._groups}.values():
            group.close()
        self._groups = []


class TensorParallelOps:
    """The two collectives a tensor-parallel model makes (engine/model/decoder.py)."""

    def __init__(self, group: RankGroup):
        self.group, self.size = group, group.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(x)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat(self.group.all_gather(x), dim=-1)
