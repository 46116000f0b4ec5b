"""The driver side of a t x p engine: starts one process per other rank, holds rank 0's
part of the model itself, and sends each step and each KV transfer to every rank.

The scheduler, the block pool and the sampler run here only. A step's model inputs
(token ids, positions, block tables, slots: what the scheduler's output becomes) go to
every rank as one typed message (engine/executor/messages.py); the logits come back here
from the last stage, so every token is sampled once, and every rank computes with the
tokens sampled here.

Ranks start, fail and stop together. A rank that exits, or a collective that gets no
answer within `collective_timeout_s`, makes every later call raise EngineDeadError
naming the rank; a watcher thread notices a rank's death while the engine idles too.
The ranks end when the driver shuts them down, or on their own when it dies (their
control pipe closes).
"""
from __future__ import annotations

import atexit
import dataclasses
import logging
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import torch

from pdserve.engine.attention.backend import AttentionBackend
from pdserve.engine.config import EngineConfig, ModelArchConfig
from pdserve.engine.errors import EngineDeadError, InvalidRequestError, ModelLoadError
from pdserve.engine.executor import messages as M
from pdserve.engine.executor.groups import ParallelGroups, RankPlace
from pdserve.engine.executor.launch import RankLaunch, rank_kv_arch, rank_shard, threads_per_rank
from pdserve.engine.executor.base import Executor
from pdserve.engine.executor.messages import StepInputs
from pdserve.engine.executor.stage import StageWorker
from pdserve.engine.kv_transfer import as_tensor
from pdserve.engine.model.loader import LoadedModel, load_model, read_arch
from pdserve.engine.model.shard import check_tensor_parallel
from pdserve.engine.model.source import ModelSource
from pdserve.engine.process_exit import killed_by

logger = logging.getLogger(__name__)


class MultiProcExecutor(Executor):
    holds_whole_model = False  # rank 0's layers and heads only

    def __init__(self, config: EngineConfig, source: ModelSource, dtype: torch.dtype, progress: bool = True):
        parallel = config.parallel
        self.parallel, self.config = parallel, config
        self.world_size = parallel.world_size
        self.num_microbatches = parallel.num_microbatches if parallel.pipeline_parallel_size > 1 else 1
        arch = read_arch(source)  # a setting the model cannot take fails before any process starts
        check_tensor_parallel(arch, parallel.tensor_parallel_size)
        parallel.stage_layers(arch.num_layers)
        device = torch.device(config.device)
        backend = parallel.distributed_backend or ("nccl" if device.type == "cuda" else "gloo")
        threads = threads_per_rank(self.world_size)
        launch = RankLaunch(0, config.model, config.dtype,
                            config.device, config.attention_backend, config.scheduler.max_model_len,
                            config.cache.block_size, parallel, backend, _free_port(), threads, config.revision,
                            config.quantization)
        self._procs: dict[int, subprocess.Popen] = {}
        self._dead: str | None = None
        self._stopping = False
        self._lock = threading.Lock()
        for rank in range(1, self.world_size):
            self._procs[rank] = subprocess.Popen(
                [sys.executable, "-m", "pdserve.engine.executor.rank_main", dataclasses.replace(launch, rank=rank).to_json()],
                stdin=subprocess.PIPE)
        atexit.register(self.shutdown)
        self._watcher = threading.Thread(target=self._watch, name="rank-watcher", daemon=True)
        self._watcher.start()
        torch.set_num_threads(min(torch.get_num_threads(), threads))
        self.place = RankPlace(0, parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
        self.device = torch.device(launch.rank_device)
        with self._guard("start-up"):
            self.groups = ParallelGroups(self.place, backend, launch.master_port, parallel.collective_timeout_s)
        try:
            self.loaded: LoadedModel = load_model(
                source, dtype, str(self.device), config.scheduler.max_model_len, progress,
                shard=lambda arch: rank_shard(self.place, parallel, arch), tp=self.groups.tp,
                quantization=config.quantization)
        except (InvalidRequestError, ModelLoadError):
            self.shutdown()
            raise
        self.arch: ModelArchConfig = self.loaded.arch
        self.kv_arch = rank_kv_arch(parallel, self.arch)
        self._shards = [rank_shard(RankPlace(r, self.place.tp_size, self.place.pp_size), parallel, self.arch)
                        for r in range(self.world_size)]
        self.worker: StageWorker | None = None

    @property
    def rank_pids(self) -> dict[int, int]:
        """The process of every rank but the driver's (rank 0 is this process)."""
        return {rank: proc.pid for rank, proc in self._procs.items()}

    def start_kv(self, num_blocks: int, kv_caches: list[torch.Tensor], backend: AttentionBackend,
                 num_host_slots: int = 0) -> None:
        """Every rank allocates `num_blocks` KV blocks (rank 0's are `kv_caches`) and a host
        buffer of `num_host_slots` blocks of its part. Returns once every rank is ready."""
        with self._guard("start-up"):
            self._send_all(M.INIT, num_blocks, num_host_slots)
            self.worker = StageWorker(self.loaded.model, kv_caches[:len(self.loaded.model.layers)], backend,
                                      self.groups, self.device, num_host_slots)
            self.groups.cpu.barrier()

    # ---- the engine's calls --------------------------------------------------------
    def forward(self, batches: list[StepInputs]) -> torch.Tensor:
        """The logits rows of every micro-batch, in order."""
        with self._guard("a step"):
            shapes, payload = M.pack_step(batches)
            self._send_all(M.STEP, len(batches), payload.shape[0], shapes)
            self.groups.cpu.broadcast(payload, src=0)
            return torch.cat(self.worker.run(batches))

    def import_blocks(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        with self._guard("a KV import"):
            self._send_all(M.KV_IMPORT, len(block_ids), 0, block_ids)
            blocks = as_tensor(blocks).to(device="cpu", dtype=self.worker.kv_caches[0].dtype).contiguous()
            self.groups.cpu.broadcast(blocks, src=0)
            self.worker.import_blocks(block_ids, blocks)

    def export_blocks(self, block_ids: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """Whole blocks ([n, layers, 2, bs, kv heads, d]), assembled from the ranks' parts."""
        with self._guard("a KV export"):
            self._send_all(M.KV_EXPORT, len(block_ids), 0, block_ids)
            arch, bs = self.arch, self.config.cache.block_size
            dtype = self.worker.kv_caches[0].dtype
            if out is None:
                out = torch.empty((len(block_ids), arch.num_layers, 2, bs, arch.num_kv_heads, arch.head_dim),
                                  dtype=dtype)
            for rank, shard in enumerate(self._shards):
                if not shard.owns_kv_heads:
                    continue
                if rank == 0:
                    part = self.worker.export_part(block_ids)
                else:
                    part = torch.empty((len(block_ids), len(shard.layers), 2, bs, len(shard.kv_heads),
                                        arch.head_dim), dtype=dtype)
                    self.groups.cpu.recv(part, src=rank)
                out[:, shard.layers.start:shard.layers.stop, :, :, shard.kv_heads.start:shard.kv_heads.stop] = part
            return out

    def copy_host_blocks(self, offloads: list[tuple[int, int]], onloads: list[tuple[int, int]]) -> None:
        """Each rank between its own cache and host buffer: no bytes cross processes."""
        with self._guard("a host KV copy"):
            self._send_all(M.HOST_COPY, len(offloads), len(onloads), M.pack_pairs(offloads, onloads))
            self.worker.copy_host_blocks(offloads, onloads)

    def check_health(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)

    def shutdown(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        for proc in self._procs.values():
            try:
                if proc.poll() is None:
                    M.write_message(proc.stdin, M.SHUTDOWN)
                proc.stdin.close()
            except (BrokenPipeError, OSError, ValueError):
                pass
        deadline = time.monotonic() + 10
        for proc in self._procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if getattr(self, "groups", None) is not None:
            self.groups.close()

    # ---- failure handling ------------------------------------------------------------
    def _send_all(self, op: int, a: int = 0, b: int = 0, ints: list[int] = ()) -> None:
        for proc in self._procs.values():
            M.write_message(proc.stdin, op, a, b, list(ints))

    @contextmanager
    def _guard(self, what: str):
        """Any failure talking to the ranks leaves the engine dead, with the reason named."""
        self.check_health()
        try:
            yield
        except (RuntimeError, OSError, ValueError) as e:
            self._dead = self._describe_failure(what, e)
            logger.error("%s", self._dead)
            raise EngineDeadError(self._dead) from e

    def _describe_failure(self, what: str, error: Exception) -> str:
        deadline = time.monotonic() + 2.0  # a rank that died takes a moment to be reaped
        while time.monotonic() < deadline and not self._exited():
            time.sleep(0.05)
        exited = self._exited()
        if exited:
            return (f"tensor/pipeline-parallel {what} failed: {'; '.join(exited)}; "
                    f"the engine's {self.world_size} ranks cannot go on")
        return (f"tensor/pipeline-parallel {what} failed: a rank did not answer within "
                f"collective_timeout_s={self.parallel.collective_timeout_s:g} ({error})")

    def _exited(self) -> list[str]:
        return [f"rank {rank} (pid {proc.pid}) {_describe_exit(proc.returncode)}"
                for rank, proc in self._procs.items() if proc.poll() is not None]

    def _watch(self) -> None:
        while not self._stopping:
            exited = self._exited()
            if exited and not self._stopping:
                self._dead = self._dead or f"{'; '.join(exited)}; the engine's {self.world_size} ranks cannot go on"
                logger.error("%s", self._dead)
                return
            time.sleep(0.2)


def _describe_exit(code: int) -> str:
    """'was killed by SIGKILL', 'exited with code 1': the end of a sentence about a rank."""
    name = killed_by(code)
    return f"exited with code {code}" if name is None else f"was killed by {name}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
