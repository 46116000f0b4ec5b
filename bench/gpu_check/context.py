"""What every check shares: its context (model, device, work folder), the engine in bfloat16
on its device, and bench/offline_throughput.py's workload."""
from __future__ import annotations

import os
from dataclasses import dataclass

GRAPH_SIZES = (1, 2, 4, 8, 16, 32, 64)


@dataclass
class Ctx:
    model: str
    device: str          # "cuda", or "cpu" for --dry-run / --cpu-logic
    work: str
    name: str

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    @property
    def backend(self) -> str:
        return "triton" if self.cuda else "cpu"

    def record_session(self, pid: int) -> None:
        """A process group the parent kills if this check runs out of time."""
        with open(os.path.join(self.work, f"{self.name}.sessions"), "a") as f:
            f.write(f"{pid}\n")


def free(*_objects) -> None:
    import gc

    import torch
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def make_llm(ctx: Ctx, graph_sizes: tuple[int, ...] = (), **kwargs):
    """The engine on ctx's device in bfloat16; `graph_sizes`: CUDA graphs for decode (on CPU,
    EagerGraph stands in for the capture, as tests/engine/test_gpu_engine_bench.py does)."""
    from pdserve.engine import LLM
    kwargs = {"kv_cache_memory_bytes": (1 << 30) if ctx.cuda else (64 << 20), "progress": False, **kwargs}
    if ctx.cuda:
        return LLM(ctx.model, dtype="bfloat16", device="cuda", attention_backend="triton",
                   cuda_graph_batch_sizes=graph_sizes, **kwargs)
    llm = LLM(ctx.model, dtype="bfloat16", device="cpu", attention_backend=ctx.backend, **kwargs)
    if graph_sizes:
        from pdserve.engine.worker.cuda_graphs import EagerGraph
        engine = llm.engine
        engine.runner.capture_decode_graphs(graph_sizes, engine.max_model_len, engine.scheduler.config.max_num_seqs,
                                            graph_type=EagerGraph)
    return llm


def workload(ctx: Ctx, num_prompts: int = 32):
    from bench.offline_throughput import make_workload
    from pdserve.engine.model.loader import read_arch
    from pdserve.engine.model.source import resolve_model
    vocab = read_arch(resolve_model(ctx.model)).vocab_size
    prompts, outputs = make_workload(vocab, num_prompts if ctx.cuda else 3, seed=0)
    if not ctx.cuda:  # the tiny model on CPU: short runs
        prompts, outputs = [p[:40] for p in prompts], [min(n, 20) for n in outputs]
    return prompts, outputs

