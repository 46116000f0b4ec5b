"""Where one engine step's time goes, by batch size: the breakdown issue 12 asks for.

For each batch size B, B requests with random prompts of --prompt-len tokens decode
together; only steps in which all B decode (no prefill) are measured. The parts are timed
by wrapping the engine's own functions for the run (nothing in the engine changes):

    gemm       every linear layer (QKV, O, gate-up, down, prepacked or not) and the LM head
    attention  the attention backend: cache write, paged gather, SDPA
    norm_rope  RMSNorm and rotary embeddings
    model_rest the rest of the forward: embedding, activations, residual adds, Python
    prepare    packing the flat batch (model runner)
    sample     sampling
    schedule   scheduler.schedule + update_from_output
    output     detokenization, stop checks, outputs
    other      the rest of EngineCore.step

    .venv/bin/python -m bench.profile_step [--batch-sizes 1,4,16,64 --threads 1] [--plain-weights]
Prints one JSON line per batch size (milliseconds per step) and a Markdown table.
"""
from __future__ import annotations

import argparse
import random
import time
from collections import defaultdict
from contextlib import contextmanager

import torch

from bench.report import emit_row
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import DEFAULT_MODEL
from pdserve.engine.engine_request import EngineRequest

PARTS = ("gemm", "attention", "norm_rope", "model_rest", "prepare", "sample", "schedule", "output", "other")


class Timers:
    def __init__(self):
        self.total = defaultdict(float)
        self.depth = 0  # only the outermost timed call counts (no double counting)

    def wrap(self, owner, name: str, part: str) -> None:
        original = getattr(owner, name)
        timers = self

        def timed(*args, **kwargs):
            if timers.depth:
                return original(*args, **kwargs)
            timers.depth += 1
            t = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                timers.total[part] += time.perf_counter() - t
                timers.depth -= 1
        setattr(owner, name, timed)


@contextmanager
def instrumented(llm: LLM):
    """Times the parts for the duration of the block; the model forward is timed as a whole
    and by its parts (nested timers run inside the forward's own)."""
    import torch.nn as nn
    import torch.nn.functional as F
    from pdserve.engine.model import decoder as llama
    from pdserve.engine.model.packed_linear import PackedLinear
    engine = llm.engine
    runner, scheduler = engine.runner, engine.scheduler
    inner, outer = Timers(), Timers()
    saved = [(nn.Linear, "forward", nn.Linear.forward), (F, "linear", F.linear),
             (PackedLinear, "forward", PackedLinear.forward), (llama.RMSNorm, "forward", llama.RMSNorm.forward),
             (type(runner.model.rope), "forward", type(runner.model.rope).forward),
             (type(runner.backend), "forward", type(runner.backend).forward)]
    inner.wrap(nn.Linear, "forward", "gemm")
    inner.wrap(PackedLinear, "forward", "gemm")
    F.linear = _timed_fn(F.linear, inner, "gemm")  # the LM head calls F.linear directly
    inner.wrap(llama.RMSNorm, "forward", "norm_rope")
    inner.wrap(type(runner.model.rope), "forward", "norm_rope")
    inner.wrap(type(runner.backend), "forward", "attention")
    wrapped = ((runner.executor, "forward", "forward"), (runner, "_prepare_inputs", "prepare"),
               (scheduler, "schedule", "schedule"), (scheduler, "update_from_output", "schedule"),
               (engine, "_process_tokens", "output"))
    instance_attrs = [(obj, name, obj.__dict__.get(name)) for obj, name, _ in wrapped]
    for obj, name, part in wrapped:
        outer.wrap(obj, name, part)
    import pdserve.engine.worker.model_runner as mr
    saved_sample = mr.sample
    mr.sample = _timed_fn(mr.sample, outer, "sample")
    try:
        yield inner, outer
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
        mr.sample = saved_sample
        for obj, name, value in instance_attrs:  # bound methods were found on the class: drop the override
            if value is None:
                del obj.__dict__[name]
            else:
                setattr(obj, name, value)


def _timed_fn(fn, timers: Timers, part: str):
    class Holder:
        pass
    holder = Holder()
    holder.fn = fn
    timers.wrap(holder, "fn", part)
    return holder.fn


def start_decode_batch(engine, batch: int, prompt_len: int, steps: int, seed: int) -> None:
    """Adds `batch` requests with random prompts of prompt_len tokens and steps until they all
    decode together; then at least `steps` all-decode steps remain before the first finishes."""
    rng = random.Random(seed)
    vocab = engine.info.vocab_size
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(batch):
        engine.add_request(EngineRequest(f"b{batch}-{i}", [rng.randrange(100, vocab) for _ in range(prompt_len)],
                                         params))
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running):
        engine.step()  # prefills, not measured
    for _ in range(2):
        engine.step()  # warm-up decode steps


def profile_batch(llm: LLM, batch: int, prompt_len: int, steps: int, seed: int) -> dict:
    engine = llm.engine
    start_decode_batch(engine, batch, prompt_len, steps, seed)
    with instrumented(llm) as (inner, outer):
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        total = time.perf_counter() - start
    while engine.has_unfinished_requests():
        engine.step()
    ms = {part: 1000 * v / steps for part, v in {**inner.total, **outer.total}.items()}
    forward = ms.pop("forward")
    row = {p: ms.get(p, 0.0) for p in ("gemm", "attention", "norm_rope")}
    row["model_rest"] = forward - sum(row.values())
    for p in ("prepare", "sample", "schedule", "output"):
        row[p] = ms.get(p, 0.0)
    row["other"] = 1000 * total / steps - forward - sum(row[p] for p in ("prepare", "sample", "schedule", "output"))
    row = {"batch": batch, "step_ms": round(1000 * total / steps, 2), **{k: round(v, 2) for k, v in row.items()},
           "context_tokens": prompt_len + steps // 2}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--batch-sizes", default="1,4,16,64")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plain-weights", action="store_true",
                        help="no prepacked GEMM weights (the A/B of engine/model/packed_linear.py)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.plain_weights:
        import pdserve.engine.worker.model_runner as model_runner
        model_runner.can_prepack = lambda *_: False
    llm = LLM(args.model, max_num_seqs=256, progress=False, kv_cache_memory_bytes=2 << 30)
    rows = []
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        row = profile_batch(llm, batch, args.prompt_len, args.steps, args.seed)
        row["threads"] = args.threads
        emit_row(row)
        rows.append(row)
    print("\n| batch | step ms | " + " | ".join(PARTS) + " |")
    print("|---" * (len(PARTS) + 2) + "|")
    for r in rows:
        print(f"| {r['batch']} | {r['step_ms']} | " + " | ".join(str(r[p]) for p in PARTS) + " |")


if __name__ == "__main__":
    main()
