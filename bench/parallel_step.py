"""Engine step time by tensor (t) and pipeline (p) parallel size (issue 17), on this machine's CPU:

    prefill    one step that prefills a single --prefill-tokens prompt (512), first token included
    decode     one all-decode step at each batch size (1, 8, 32): bench/profile_step.py's batches,
               B requests with --prompt-len-token prompts, only steps where all B decode timed
    overlap    p=2 with the step cut into 2 micro-batches (the engine's default: one per stage)
               against the same with micro-batching off (pipeline_microbatches=1), on steps
               that hold two micro-batches: a prefill of 2 x --prefill-tokens/2 and a decode
               at the largest batch size

Each number is the whole `llm.engine.step()` (schedule, inputs to every rank, forward,
collectives, sample, outputs), the median over --repeats of the mean over --steps steps.
Each (t, p) runs in a fresh process (its ranks and its torch.distributed group with it); the
engine shares this process's cores out between its ranks (engine/executor/launch.py), so
every configuration uses the same cores.

    .venv/bin/python -m bench.parallel_step                       # (1,1) (3,1) (1,2) (3,2), --repeats 3
    .venv/bin/python -m bench.parallel_step --configs 1x1,3x1 --repeats 1

SmolLM2-135M has 3 KV heads: t must divide 3. Prints one JSON line per run, then Markdown
tables: step ms, the ratios to t=p=1, and the micro-batch overlap. bench/gpu_parallel.py is
the same on GPUs.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

from bench.report import emit_row, markdown_table
from pdserve.engine.config import DEFAULT_MODEL
from pdserve.engine.engine_request import EngineRequest

CONFIGS = "1x1,3x1,1x2,3x2"


def parse_args(argv: list[str] | None = None, device: str = "cpu") -> argparse.Namespace:
    gpu = device == "cuda"
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--configs", default=CONFIGS, help="TxP list, e.g. 1x1,3x1,1x2,3x2")
    parser.add_argument("--prefill-tokens", type=int, default=2048 if gpu else 512)
    parser.add_argument("--batch-sizes", default="1,8,32", help="decode step time at these batch sizes")
    parser.add_argument("--prompt-len", type=int, default=128, help="prompt tokens of the decode batches")
    parser.add_argument("--steps", type=int, default=50 if gpu else 10, help="timed steps per repeat")
    parser.add_argument("--repeats", type=int, default=3, help="the median of this many repeats is reported")
    parser.add_argument("--no-overlap", action="store_true", help="skip the micro-batch overlap runs")
    parser.add_argument("--dtype", default="bfloat16" if gpu else "float32")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=(4 << 30) if gpu else (1 << 30))
    parser.add_argument("--collective-timeout-s", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the child: "t,p,microbatches"
    args = parser.parse_args(argv)
    args.device = device
    args.attention_backend = "triton" if gpu else "cpu"
    return args


def parse_configs(text: str) -> list[tuple[int, int]]:
    try:
        configs = [tuple(int(n) for n in part.lower().split("x")) for part in text.split(",") if part.strip()]
    except ValueError:
        configs = []
    if not configs or any(len(c) != 2 or min(c) < 1 for c in configs):
        sys.exit(f"--configs: expected TxP pairs like 1x1,3x2, got {text!r}")
    return configs


# ---- the child: one engine, every workload ------------------------------------------

def _synchronize(device: str) -> None:
    if device == "cuda":
        import torch
        torch.cuda.synchronize()


def timed_steps(engine, steps: int, device: str) -> float:
    """ms per engine step over `steps` steps (sampling reads tokens back: each ends synchronized)."""
    _synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return 1000 * (time.perf_counter() - start) / steps


def prefill_step_ms(engine, prompt_lens: list[int], steps: int, rng: random.Random, device: str) -> float:
    """ms of a step that prefills len(prompt_lens) fresh prompts whole (prefix caching is off)."""
    from pdserve.engine import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    total = 0.0
    for i in range(steps):
        for j, n in enumerate(prompt_lens):
            engine.add_request(EngineRequest(f"p{rng.random()}-{i}-{j}", [rng.randrange(100, engine.info.vocab_size)
                                                           for _ in range(n)], params))
        total += timed_steps(engine, 1, device)
        while engine.has_unfinished_requests():  # nothing should be left: each prompt fits one step
            engine.step()
    return total / steps


def decode_step_ms(engine, batch: int, prompt_len: int, steps: int, seed: int, device: str) -> float:
    from bench.profile_step import start_decode_batch
    start_decode_batch(engine, batch, prompt_len, steps, seed)
    ms = timed_steps(engine, steps, device)
    while engine.has_unfinished_requests():
        engine.step()
    return ms


def measure(args, t: int, p: int, microbatches: int | None) -> dict:
    import torch
    from pdserve.engine import LLM
    batches = [int(b) for b in args.batch_sizes.split(",")]
    if args.device == "cpu":  # every configuration gets this process's cores (the executor shares them out)
        torch.set_num_threads(len(os.sched_getaffinity(0)))
    llm = LLM(args.model, dtype=args.dtype, device=args.device, attention_backend=args.attention_backend,
              tensor_parallel_size=t, pipeline_parallel_size=p, pipeline_microbatches=microbatches,
              collective_timeout_s=args.collective_timeout_s, enable_prefix_caching=False,
              max_num_seqs=max(batches), max_num_batched_tokens=max(args.prefill_tokens, max(batches)),
              long_prefill_token_threshold=args.prefill_tokens, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
              progress=False)
    engine, rng = llm.engine, random.Random(args.seed)
    prefill_steps = max(1, args.steps // 5)
    try:
        prefill_step_ms(engine, [args.prefill_tokens], 1, rng, args.device)  # warm-up (kernels, allocator)
        runs = {"prefill": [], "prefill_2x": [], **{f"decode_{b}": [] for b in batches}}
        for r in range(args.repeats):
            runs["prefill"].append(prefill_step_ms(engine, [args.prefill_tokens], prefill_steps, rng, args.device))
            half = args.prefill_tokens // 2
            runs["prefill_2x"].append(prefill_step_ms(engine, [half, half], prefill_steps, rng, args.device))
            for b in batches:
                runs[f"decode_{b}"].append(decode_step_ms(engine, b, args.prompt_len, args.steps,
                                                          args.seed + r, args.device))
    finally:
        engine.shutdown()
    return {"t": t, "p": p, "microbatches": microbatches or p, "ranks": t * p,
            "cores": len(os.sched_getaffinity(0)), "device": args.device,
            **{name: round(statistics.median(v), 3) for name, v in runs.items()},
            "runs": {name: [round(x, 3) for x in v] for name, v in runs.items()}}


# ---- the parent: one child per configuration, then the tables --------------------------

def run_child(module: str, argv: list[str], t: int, p: int, microbatches: int | None) -> dict | None:
    one = f"{t},{p},{microbatches or 0}"
    # the child and its ranks (`python -m pdserve.engine.executor.rank_main`) find the repo from anywhere
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", module, *argv, "--one", one], stdout=subprocess.PIPE, text=True,
                          env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        print(f"(t={t}, p={p}, microbatches={microbatches}): failed, exit {done.returncode}", file=sys.stderr)
        return None
    row = json.loads(lines[-1])
    emit_row(row)
    return row


def print_tables(args, rows: list[dict], overlap: tuple[dict, dict] | None) -> None:
    batches = [int(b) for b in args.batch_sizes.split(",")]
    cols = ["prefill"] + [f"decode_{b}" for b in batches]
    heads = [f"prefill {args.prefill_tokens} tok"] + [f"decode b={b}" for b in batches]
    print(f"\nstep ms ({rows[0]['device']}, {rows[0]['cores']} cores, {args.model}, median of {args.repeats})\n")
    print(markdown_table(["t", "p", "ranks", *heads],
                         [[r["t"], r["p"], r["ranks"], *(f"{r[c]:.1f}" for c in cols)] for r in rows]))
    base = next((r for r in rows if r["ranks"] == 1), None)
    if base is not None:
        print("\nstep time / t=p=1's (below 1: faster)\n")
        print(markdown_table(["t", "p", *heads],
                             [[r["t"], r["p"], *(f"{r[c] / base[c]:.2f}" for c in cols)] for r in rows]))
    if overlap:
        off, on = overlap
        b = batches[-1]
        print(f"\npipeline micro-batch overlap, p={on['p']} t={on['t']}: step ms\n")
        steps = ((f"prefill 2 x {args.prefill_tokens // 2} tok", "prefill_2x"), (f"decode b={b}", f"decode_{b}"))
        print(markdown_table(["step", "1 micro-batch", f"{on['microbatches']} micro-batches", "speedup"],
                             [[name, f"{off[col]:.1f}", f"{on[col]:.1f}", f"{off[col] / on[col]:.2f}"]
                              for name, col in steps]))


def run_all(args, module: str, argv: list[str], configs: list[tuple[int, int]]) -> int:
    """`module`: the script the children run (`python -m module ... --one t,p,mb`)."""
    rows = [row for t, p in configs if (row := run_child(module, argv, t, p, None)) is not None]
    overlap = None
    on = next((r for r in rows if r["t"] == 1 and r["p"] == 2), None)
    if not args.no_overlap and on is not None:
        off = run_child(module, argv, 1, 2, 1)
        overlap = None if off is None else (off, on)
    if rows:
        print_tables(args, rows, overlap)
    return 0 if len(rows) == len(configs) else 1


def child_main(args) -> int:
    t, p, mb = (int(n) for n in args.one.split(","))
    emit_row(measure(args, t, p, mb or None))
    return 0


def main() -> int:
    argv = sys.argv[1:]
    args = parse_args(argv)
    if args.one:
        return child_main(args)
    return run_all(args, "bench.parallel_step", argv, parse_configs(args.configs))


if __name__ == "__main__":
    sys.exit(main())
