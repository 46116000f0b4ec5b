"""Served calm latency against vLLM's OpenAI server, measured by guidellm (a benchmark
nobody here wrote): 64-token prompts, 128 output tokens, 2 concurrent streams, no other
load. Each platform gets the same 2 cores. pdserve runs twice: as `pdserve up` starts it
(1 prefill + 1 decode worker, one core each) and colocated (one decode worker on both
cores, which prefills its own prompts); then vLLM serves the same model (an HF folder
saved by bench/offline_throughput.py). Prints one JSON line with ITL/TTFT p50/p90 per
platform and the ITL p90 ratios against vLLM.

`--bursts`: each platform is measured twice, calm and then while long prompts (--burst-len
tokens, 16 output tokens each) arrive back to back from another client, one after the
other; the line adds each platform's ITL p90 ratio bursts / calm (issue 13's isolation as a
client nobody here wrote measures it).

`--dtype bfloat16` serves pdserve and vLLM in bf16; `--quantization gguf` serves pdserve in the
embedded file's own Q4_1/Q8_0 blocks (the weights llama.cpp computes with). `--llama-server BIN_DIR` adds llama.cpp's
server (../shared/peers.md) on the embedded GGUF: it computes with its own 4-bit weights, so
it is what a CPU user would pick, not a same-precision race. The bursts line also gives
TTFT p90 bursts / calm and the long prompts' own latency (what they pay for the others).

    .venv/bin/python -m bench.serve_itl_vs_vllm --guidellm $TMPDIR/guidellm/bin/guidellm \\
        --vllm-python $TMPDIR/vllm-peer/bin/python [--requests 12] [--bursts] [--dtype bfloat16] \\
        [--llama-server $(dirname of llama-server-vulkan's ggml libs)]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import replace

from bench.machine import read_cpu_flags
from bench.report import emit_result
from pdserve.cli.bench.local_platform import local_platform
from pdserve.cli.launcher import PlatformConfig
from pdserve.engine.config import DEFAULT_MODEL


# each pdserve platform on the same 2 cores as vLLM
PLATFORMS = {"pdserve_1p1d": PlatformConfig(num_prefill=1, num_decode=1),
             "pdserve_colocated_2cores": PlatformConfig(num_prefill=0, num_decode=1, cpus_per_worker=2)}


def guidellm(binary: str, base_url: str, hf_dir: str, requests: int, out_dir: str, name: str) -> dict:
    out = os.path.join(out_dir, f"{name}.json")
    cmd = [binary, "run", "--backend", f"kind=openai_http,target={base_url}", "--tokenizer",
           f"kind=hf_auto,model={hf_dir}", "--profile", "kind=concurrent,streams=2", "--data",
           "kind=synthetic_text,prompt_tokens=64,output_tokens=128", "--constraint",
           f"kind=max_requests,count={requests}", "--output", f"kind=json,path={out}",
           "--disable-progress", "--disable-console"]
    subprocess.run(cmd, check=True, capture_output=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    with open(out) as f:
        metrics = json.load(f)["benchmarks"][0]["metrics"]
    row = {}
    for key, name_ in (("inter_token_latency_ms", "itl"), ("time_to_first_token_ms", "ttft")):
        pct = metrics[key]["successful"]["percentiles"]
        row[f"{name_}_p50_ms"], row[f"{name_}_p90_ms"] = round(pct["p50"], 1), round(pct["p90"], 1)
    return row


@contextmanager
def long_prompts_back_to_back(base_url: str, model: str, prompt_len: int):
    """While inside: one /v1/completions request of `prompt_len` random token ids at a time,
    the next sent when the previous answers. Yields the list of their latencies (s)."""
    stop = threading.Event()
    latencies: list[float] = []

    def send_forever() -> None:
        rng = random.Random(0)
        while not stop.is_set():
            body = json.dumps({"model": model, "prompt": [rng.randrange(1000, 30000) for _ in range(prompt_len)],
                               "max_tokens": 16, "temperature": 0.0}).encode()
            request = urllib.request.Request(f"{base_url}/v1/completions", data=body,
                                             headers={"Content-Type": "application/json"})
            t = time.monotonic()
            try:
                urllib.request.urlopen(request, timeout=600).read()
                latencies.append(time.monotonic() - t)
            except OSError as e:
                print(f"burst request failed: {e}", file=sys.stderr)
                stop.wait(1.0)

    thread = threading.Thread(target=send_forever, daemon=True)
    thread.start()
    try:
        yield latencies
    finally:
        stop.set()
        thread.join(timeout=600)


def measure(args, base: str, name: str, model: str) -> dict:
    """Calm, and with --bursts also under long prompts: {name: row, name_bursts: row, ratio}."""
    guidellm(args.guidellm, base, args.hf_dir, 2, args.out_dir, f"{name}-warmup")
    rows = {name: guidellm(args.guidellm, base, args.hf_dir, args.requests, args.out_dir, name)}
    if args.bursts:
        with long_prompts_back_to_back(base, model, args.burst_len) as latencies:
            time.sleep(2.0)  # the first long prompt is in its prefill when the streams start
            rows[f"{name}_bursts"] = guidellm(args.guidellm, base, args.hf_dir, args.requests, args.out_dir,
                                              f"{name}-bursts")
        rows[f"{name}_bursts"]["long_prompts_done"] = len(latencies)
        if latencies:
            ordered = sorted(latencies)
            rows[f"{name}_bursts"]["long_prompt_latency_p50_s"] = round(ordered[len(ordered) // 2], 2)
            rows[f"{name}_bursts"]["long_prompt_latency_max_s"] = round(ordered[-1], 2)
        for metric in ("itl", "ttft"):
            rows[f"{name}_{metric}_p90_bursts_vs_calm"] = round(rows[f"{name}_bursts"][f"{metric}_p90_ms"]
                                                                / rows[name][f"{metric}_p90_ms"], 2)
    return rows


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, port: int, name: str, log_path: str, timeout_s: float = 900):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited ({proc.returncode}); see {log_path}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return
        except OSError:
            time.sleep(2)
    proc.kill()
    raise TimeoutError(f"{name} did not start in {timeout_s:.0f} s")


def run_llama_server(bin_dir: str, gguf: str, log_path: str):
    """llama.cpp's server on the same GGUF and 2 cores: 2 slots (the 2 streams), 2,048 tokens each."""
    port = _free_port()
    binary = next(os.path.join(bin_dir, b) for b in ("llama-server", "llama-server-vulkan")
                  if os.path.isfile(os.path.join(bin_dir, b)))
    log = open(log_path, "w")
    proc = subprocess.Popen([binary, "-m", gguf, "-t", "2", "-c", "4096", "-np", "2", "--host", "127.0.0.1",
                             "--port", str(port)], env=dict(os.environ, LD_LIBRARY_PATH=bin_dir),
                            stdout=log, stderr=log)
    wait_healthy(proc, port, "llama-server", log_path, timeout_s=120)
    return proc, port


def run_vllm_server(python: str, hf_dir: str, log_path: str, dtype: str = "float32"):
    port = _free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="2",
               VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_NO_USAGE_STATS="1")
    log = open(log_path, "w")
    proc = subprocess.Popen([python, "-m", "vllm.entrypoints.openai.api_server", "--model", hf_dir,
                             "--served-model-name", DEFAULT_MODEL, "--dtype", dtype, "--max-model-len", "2048",
                             "--host", "127.0.0.1", "--port", str(port)], env=env, stdout=log, stderr=log)
    wait_healthy(proc, port, "vLLM server", log_path)
    return proc, port


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--guidellm", required=True, help="the guidellm executable (its own environment)")
    parser.add_argument("--vllm-python", default=None)
    parser.add_argument("--hf-dir", default=os.path.join(tempfile.gettempdir(), "pdserve-smollm2-hf"))
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--out-dir", default="bench/results/serve_itl_vs_vllm")
    parser.add_argument("--bursts", action="store_true", help="also measure while long prompts arrive")
    parser.add_argument("--burst-len", type=int, default=1900, help="tokens of each long prompt")
    parser.add_argument("--platforms", default="pdserve_1p1d,pdserve_colocated_2cores",
                        help="which pdserve platforms to measure (comma-separated; none: peers only)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="pdserve's and vLLM's")
    parser.add_argument("--quantization", default=None, choices=("gguf",),
                        help="pdserve's workers' --quantization: gguf computes with the embedded file's own 4-bit "
                             "blocks, as llama.cpp does")
    parser.add_argument("--prefill-args", default="", help="more flags for pdserve's prefill workers, e.g. "
                                                            "'--max-step-ms 150'")
    parser.add_argument("--llama-server", default=None,
                        help="the folder of llama.cpp's llama-server and its ggml libraries: also measure it")
    args = parser.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    if not os.path.isfile(os.path.join(args.hf_dir, "config.json")):
        from pdserve.engine.model.source import resolve_model
        from bench.offline_throughput import save_hf_folder
        save_hf_folder(resolve_model(DEFAULT_MODEL).path, args.hf_dir)
    result = {}
    names = [n for n in args.platforms.split(",") if n]
    for name in names:
        cfg = replace(PLATFORMS[name], worker_args=(*PLATFORMS[name].worker_args, "--dtype", args.dtype),
                      quantization=args.quantization,
                      prefill_args=(*PLATFORMS[name].prefill_args, *shlex.split(args.prefill_args)))
        with local_platform(cfg, os.path.join(args.out_dir, f"{name}.log"), http=True) as platform:
            result.update(measure(args, f"http://127.0.0.1:{platform.cfg.http_port}", name, DEFAULT_MODEL))
    peers = []  # (name, a function starting its server: -> (process, port))
    if args.vllm_python:
        peers.append(("vllm", lambda: run_vllm_server(args.vllm_python, args.hf_dir,
                                                      os.path.join(args.out_dir, "vllm.log"), args.dtype)))
    if args.llama_server:
        from pdserve.engine.model.source import resolve_model
        peers.append(("llama_cpp", lambda: run_llama_server(args.llama_server, resolve_model(DEFAULT_MODEL).path,
                                                            os.path.join(args.out_dir, "llama-server.log"))))
    for peer, start in peers:
        try:
            proc, port = start()
        except RuntimeError as e:  # the platforms and peers measured so far still count
            print(f"{peer} did not start, not measured: {e}", file=sys.stderr)
            result[f"{peer}_error"] = str(e)
            continue
        try:
            result.update(measure(args, f"http://127.0.0.1:{port}", peer, DEFAULT_MODEL))
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        for name in names:
            result[f"{name}_itl_p90_vs_{peer}"] = round(result[name]["itl_p90_ms"] / result[peer]["itl_p90_ms"], 2)
    result["dtype"] = args.dtype
    result["quantization"] = args.quantization
    result["cpu"] = read_cpu_flags()
    emit_result(result)


if __name__ == "__main__":
    main()
