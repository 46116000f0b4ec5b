"""One group of an engine's ranks, held by the engine itself.

torch.distributed's default group is one per process: a driver that joined it for a first
engine could not start a second engine until the first was shut down. A `RankGroup` wraps
a process group built straight on the engine's own store, never registered with
torch.distributed, so every engine in a process has its own groups and shutting one down
leaves the others working. Ranks here are the group's own (0 .. size - 1).
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist


class RankGroup:
    def __init__(self, backend: dist.ProcessGroupGloo | dist.ProcessGroupNCCL, size: int):
        self._backend, self.size = backend, size

    @classmethod
    def open(cls, store: dist.Store, name: str, rank: int, size: int, backend: str,
             timeout: datetime.timedelta) -> RankGroup:
        """Joins group `name` on `store`: blocks until its `size` ranks have all joined.
        Every collective and transfer of the group fails after `timeout`."""
        group_store = dist.PrefixStore(f"{name}/", store)
        if backend == "gloo":
            return cls(dist.ProcessGroupGloo(group_store, rank, size, timeout), size)
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            options.group_name = name  # tells the groups apart in NCCL's watchdog reports
            return cls(dist.ProcessGroupNCCL(group_store, rank, size, options), size)
        raise ValueError(f"distributed backend {backend!r}: 'gloo' or 'nccl'")

    def broadcast(self, x: torch.Tensor, src: int) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = src
        self._backend.broadcast([x], options).wait()

    def send(self, x: torch.Tensor, dst: int) -> None:
        self.isend(x, dst).wait()

    def isend(self, x: torch.Tensor, dst: int) -> dist.Work:
        """Returns at once; `x` must stay untouched until the returned work's wait()."""
        return self._backend.send([x], dst, 0)

    def recv(self, x: torch.Tensor, src: int) -> None:
        self._backend.recv([x], src, 0).wait()

    def barrier(self) -> None:
        self._backend.barrier().wait()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums `x` over the ranks, in place."""
        self._backend.allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `x`, in rank order."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self._backend.allgather([parts], [x]).wait()
        return parts

    def close(self) -> None:
        self._backend.shutdown()
