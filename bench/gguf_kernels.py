"""The GGUF row kernel (kernels/cpu/gguf_linear.cpp) per block type against the float32 row
kernel on the same shape, in one sitting: a 4096 x 4096 weight (a 7-8B Llama's attention
projection: 64 MiB in float32, so every call streams it from memory), 1 and 2 rows of x, one
thread then all. Reported as G weights read per second and as time against float32's.
The blocks are random bytes: the kernel's work does not depend on their values.

    .venv/bin/python -m bench.gguf_kernels [--n 4096] [--k 4096]
"""
from __future__ import annotations

import argparse
import time

import torch

from bench.machine import read_cpu_flags
from bench.report import emit_result, emit_row
from pdserve.engine.model.gguf_linear import KEPT_TYPES, row_bytes
from pdserve.kernels.cpu import skinny_linear, skinny_linear_gguf


def best_ms(fn, repeats: int = 20) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1000


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=4096, help="output features")
    p.add_argument("--k", type=int, default=4096, help="input features (a multiple of 256)")
    args = p.parse_args()
    generator = torch.Generator().manual_seed(0)
    weights = {"fp32": torch.randn(args.n, args.k, generator=generator)}
    for name, ggml_type in KEPT_TYPES.items():
        weights[name] = torch.randint(0, 256, (args.n, row_bytes(args.k, ggml_type)), dtype=torch.uint8,
                                      generator=generator)
    result: dict = {"shape": [args.n, args.k], "rows": {}, "cpu": read_cpu_flags()}
    all_threads = torch.get_num_threads()
    for threads in sorted({1, all_threads}):
        torch.set_num_threads(threads)
        for rows in (1, 2):
            x = torch.randn(rows, args.k, generator=generator)
            row = {}
            for name, weight in weights.items():
                if name == "fp32":
                    ms = best_ms(lambda: skinny_linear(x, weight))
                else:
                    ms = best_ms(lambda: skinny_linear_gguf(x, weight, KEPT_TYPES[name]))
                row[name] = {"ms": round(ms, 3), "g_weights_s": round(args.n * args.k / ms / 1e6, 2),
                             "vs_fp32": round(ms / row["fp32"]["ms"], 2) if "fp32" in row else 1.0}
            emit_row({"threads": threads, "rows": rows, **row})
            result["rows"][f"{threads}t_{rows}r"] = row
    emit_result(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
