"""A rank process of a t x p engine (not rank 0, which is the driver): loads its part of
the model, then runs what the driver sends until SHUTDOWN or the driver's end of file.

    python -m pdserve.engine.executor.rank_main '<RankLaunch JSON>'
"""
from __future__ import annotations

import logging
import sys

import torch

from pdserve.engine.attention.selector import get_attention_backend
from pdserve.engine.executor import messages as M
from pdserve.engine.executor.groups import ParallelGroups
from pdserve.engine.executor.launch import RankLaunch, rank_kv_arch, rank_shard
from pdserve.engine.executor.stage import StageWorker
from pdserve.engine.model.loader import load_model, parse_dtype
from pdserve.engine.model.packed_linear import can_prepack
from pdserve.engine.model.source import resolve_model
from pdserve.engine.worker.host_malloc import keep_freed_memory
from pdserve.engine.worker.kv_cache import allocate_kv_caches

logger = logging.getLogger("pdserve.rank")


def main(argv: list[str]) -> int:
    launch = RankLaunch.from_json(argv[1])
    torch.set_num_threads(launch.threads)
    place, parallel = launch.place, launch.parallel
    device = torch.device(launch.rank_device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    groups = ParallelGroups(place, launch.backend, launch.master_port, parallel.collective_timeout_s)
    dtype = parse_dtype(launch.dtype)
    loaded = load_model(resolve_model(launch.model, launch.revision), dtype, str(device), launch.max_model_len, progress=False,
                        shard=lambda arch: rank_shard(place, parallel, arch), tp=groups.tp,
                        quantization=launch.quantization)
    if can_prepack(device, dtype):
        loaded.model.prepack()
    pipe = sys.stdin.buffer
    header = M.read_exact(pipe, M.HEADER.size)
    if header is None:
        return 0
    op, num_blocks, num_host_slots = M.HEADER.unpack(header)
    if op != M.INIT:
        raise RuntimeError(f"rank {place.rank}: expected INIT from the driver, got op {op}")
    if device.type == "cpu":
        keep_freed_memory()
    kv_caches = allocate_kv_caches(num_blocks, rank_kv_arch(parallel, loaded.arch), launch.block_size, dtype, device)
    kv_caches = kv_caches[:len(loaded.model.layers)]
    worker = StageWorker(loaded.model, kv_caches, get_attention_backend(launch.attention_backend), groups, device,
                         num_host_slots)
    groups.cpu.barrier()  # ready: the driver's start-up returns
    block_shape = (loaded.arch.num_layers, 2, launch.block_size, loaded.arch.num_kv_heads, loaded.arch.head_dim)
    try:
        return _serve(pipe, worker, groups, dtype, device, block_shape)
    finally:
        groups.close()


def _serve(pipe, worker: StageWorker, groups: ParallelGroups, dtype: torch.dtype, device: torch.device,
           block_shape: tuple[int, ...]) -> int:
    while True:
        header = M.read_exact(pipe, M.HEADER.size)
        if header is None:  # the driver is gone
            return 0
        op, a, b = M.HEADER.unpack(header)
        if op == M.SHUTDOWN:
            return 0
        if op == M.STEP:
            shapes = M.read_ints(pipe, a * M.SHAPE_FIELDS)
            payload = torch.empty(b, dtype=torch.int64)
            groups.cpu.broadcast(payload, src=0)
            worker.run(M.unpack_step(shapes, payload, device))
        elif op == M.KV_IMPORT:
            block_ids = M.read_ints(pipe, a)
            blocks = torch.empty((a, *block_shape), dtype=dtype)
            groups.cpu.broadcast(blocks, src=0)
            worker.import_blocks(block_ids, blocks)
        elif op == M.KV_EXPORT:
            block_ids = M.read_ints(pipe, a)
            if worker.shard.owns_kv_heads:
                groups.cpu.send(worker.export_part(block_ids).contiguous(), dst=0)
        elif op == M.HOST_COPY:
            worker.copy_host_blocks(*M.unpack_pairs(M.read_ints(pipe, 2 * (a + b)), a, b))
        else:
            raise RuntimeError(f"rank {groups.place.rank}: unknown op {op} from the driver")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rank %(process)d %(levelname)s %(message)s")
    sys.exit(main(sys.argv))
