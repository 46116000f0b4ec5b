"""How much of a decode core's speed does the *other* core take away? The floor under the
isolation ratio that disaggregation can reach on this machine (issue 13).

The engine decodes a batch of 2 streams on core 0 (one torch thread), while core 1 is:
- idle;
- busy computing without touching memory (an integer loop: the scheduler's share alone);
- streaming memory (numpy copies of 256 MB arrays: the shared L3 and memory bus alone);
- prefilling (a second engine prefilling 1,900-token prompts back to back: what a prefill
  worker next to a decode worker does during a burst).

Prints one JSON line per case: the median decode step time and its ratio to idle. Two
workers on separate cores still share the last-level cache and the memory bus; where the
memory case is well above 1, no placement of processes on this machine can bring a decode
stream's ITL under bursts to its calm value.

    .venv/bin/python -m bench.cpu_contention [--decode-cpu 0 --other-cpu 1 --tokens 96]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

from bench.report import emit_row
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import DEFAULT_MODEL

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PREFILL_LOOP = f"""
import random, torch
torch.set_num_threads(1)
from pdserve.engine import LLM, SamplingParams
llm = LLM(model={DEFAULT_MODEL!r}, enable_prefix_caching=False, progress=False)
while True:
    prompt = {{"prompt_token_ids": [random.randrange(1000, 20000) for _ in range(1900)]}}
    llm.generate([prompt], SamplingParams(max_tokens=1))
"""

NEIGHBOURS = {
    "idle": None,
    "compute only (integer loop)": "x = 0\nwhile True:\n    x = (x * 1103515245 + 12345) & 0xFFFFFFFF",
    "memory stream (numpy copy, 256 MB)": ("import numpy as np\na = np.ones(1 << 25)\nb = np.empty_like(a)\n"
                                           "while True:\n    np.copyto(b, a)"),
    "prefill (1,900-token prompts back to back)": _PREFILL_LOOP,
}


def decode_step_ms(llm: LLM, tokens: int) -> float:
    """Mean step time of a batch-2 decode of `tokens` tokens (the 64-token prompts are
    prefix-cache hits after the first call, so the time is the decode's)."""
    prompts = [{"prompt_token_ids": [1000 + i for i in range(64)]}, {"prompt_token_ids": [2000 + i for i in range(64)]}]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params)
    return (time.perf_counter() - start) / tokens * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decode-cpu", type=int, default=0)
    parser.add_argument("--other-cpu", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.sched_setaffinity(0, {args.decode_cpu})
    torch.set_num_threads(1)
    llm = LLM(model=DEFAULT_MODEL, progress=False)
    decode_step_ms(llm, args.tokens)  # warm-up, and the prompts into the prefix cache
    idle = None
    for name, code in NEIGHBOURS.items():
        neighbour = None
        if code is not None:
            # `python -c` imports from its working directory: the repository's engine
            neighbour = subprocess.Popen(["taskset", "-c", str(args.other_cpu), sys.executable, "-c", code],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
            time.sleep(25 if "prefill" in name else 2)  # the prefill engine loads its model first
        try:
            step = statistics.median(decode_step_ms(llm, args.tokens) for _ in range(args.repeats))
        finally:
            if neighbour is not None:
                neighbour.kill()
                neighbour.wait()
        idle = idle or step
        emit_row({"other core": name, "decode step ms (batch 2)": round(step, 1),
                  "ratio to idle": round(step / idle, 2)})


if __name__ == "__main__":
    main()
