"""Model load time: pdserve's loader against transformers' own load of the same GGUF file.

Both sides load weights (dequantized to float32) and the tokenizer; each is timed in a
fresh subprocess so neither profits from the other's file cache warm-up more than once
(one untimed warm-up read of the file comes first).

    .venv/bin/python -m bench.load_time [--model smollm2] [--repeats 2]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from pdserve.engine.config import DEFAULT_MODEL

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PDSERVE = """
import time, torch
t = time.perf_counter()
from pdserve.engine.config import DEFAULT_MODEL
from pdserve.engine.model.loader import load_model
from pdserve.engine.model.source import resolve_model
load_model(resolve_model({model!r}), torch.float32, "cpu", progress=False)
print(time.perf_counter() - t)
"""

HF = """
import os, time, torch
t = time.perf_counter()
from transformers import AutoModelForCausalLM, AutoTokenizer
from pdserve.engine.model.source import resolve_model
p = resolve_model({model!r}).path
d, f = os.path.dirname(p), os.path.basename(p)
AutoTokenizer.from_pretrained(d, gguf_file=f)
AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
print(time.perf_counter() - t)
"""


def timed(code: str) -> float:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    timed(PDSERVE.format(model=args.model))  # warm the page cache
    ours = [timed(PDSERVE.format(model=args.model)) for _ in range(args.repeats)]
    hf = [timed(HF.format(model=args.model)) for _ in range(args.repeats)]
    print(json.dumps({"model": args.model, "pdserve_load_s": round(statistics.median(ours), 2),
                      "hf_load_s": round(statistics.median(hf), 2),
                      "ratio_vs_hf": round(statistics.median(hf) / statistics.median(ours), 2)}))


if __name__ == "__main__":
    main()
