"""What the prefill worker's step bound (--max-step-ms) costs a long prompt: one prompt's
prefill time on one thread, one engine per bound, the bounds interleaved over rounds so
that the machine's drift falls on all of them alike. pdserve against itself (a diagnosis,
not a peer comparison); prints one JSON line with each bound's median and rounds.

    .venv/bin/python -m bench.prefill_step_bound [--bounds 0,150,500 --prompt-len 1024 --rounds 3]
        [--min-class-ttft-ms 6000]

`--min-class-ttft-ms`: each prompt carries it as a router would (PrefillRequest.
min_class_ttft_ms), so a bound is lengthened as the SLO allows (engine/core/step_bound.py);
0 (default): none, the bound as given. Each prompt's steps are counted too.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from bench.machine import read_cpu_flags
from bench.report import emit_result
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import DEFAULT_MODEL
from pdserve.engine.engine_request import EngineRequest, RequestMode
from pdserve.engine.slo import SLOTargets


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bounds", default="0,150,500", help="max_step_ms values, comma-separated (0: no bound)")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-class-ttft-ms", type=float, default=0.0,
                   help="the tightest SLO class's TTFT target each prompt carries (0: none)")
    args = p.parse_args()
    bounds = [float(b) for b in args.bounds.split(",")]
    torch.set_num_threads(1)  # one prefill worker's core
    engines = {b: LLM(DEFAULT_MODEL, progress=False, enable_prefix_caching=False, scheduling_policy="srpt",
                      max_step_ms=b) for b in bounds}
    rng = random.Random(args.seed)
    vocab = next(iter(engines.values())).engine.loaded.arch.vocab_size
    one_token = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    submitted = iter(range(1 << 30))

    def prefill(llm: LLM) -> int:
        """One prompt prefilled as a prefill worker's request; its number of steps."""
        core = llm.engine
        core.add_request(EngineRequest(f"p{next(submitted)}", [rng.randrange(100, vocab) for _ in range(args.prompt_len)],
                                       one_token, mode=RequestMode.PREFILL_ONLY,
                                       slo=SLOTargets(min_class_ttft_s=args.min_class_ttft_ms / 1000)))
        steps = 0
        while core.has_unfinished_requests():
            core.step()
            steps += 1
        return steps
    for llm in engines.values():  # warm: no bound pays first-call costs (nor, with a bound, an unmeasured rate)
        prefill(llm)
    seconds: dict[float, list[float]] = {b: [] for b in bounds}
    num_steps: dict[float, int] = {}
    for _ in range(args.rounds):
        for b, llm in engines.items():
            start = time.perf_counter()
            num_steps[b] = prefill(llm)
            seconds[b].append(round(time.perf_counter() - start, 3))
    emit_result({"prompt_len": args.prompt_len, "cpu": read_cpu_flags(), "threads": 1,
                 "min_class_ttft_ms": args.min_class_ttft_ms,
                 "bounds": {f"{b:g}": {"median_s": statistics.median(s), "steps": num_steps[b],
                                       "tok_s": round(args.prompt_len / statistics.median(s)), "rounds": s}
                            for b, s in seconds.items()}})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
