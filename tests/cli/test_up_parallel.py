"""`pdserve up` with pools of different tensor-parallel sizes: the KV hand-off through the
kvstore carries whole blocks, so a t = 3 prefill feeds a t = 1 decode and the reverse,
token for token as the offline single-rank engine. A killed rank takes its worker down
with an error naming it; the supervisor restarts the worker and requests keep completing.

The model is a tiny random Llama with 6 attention heads and 3 KV heads (t = 3 divides
both, like SmolLM2's 9 and 3), so the two platforms start in seconds, not minutes.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from cli.bench.local_platform import free_port_range
from engine import LLM, SamplingParams
from services.router.client import RouterClient
from tests.cli.test_up_faults import Platform
from tests.models import build_tiny_llama

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
# long enough (over --short-prompt-tokens) to be prefilled by the prefill worker
PROMPTS = [f"request {i}: the quick brown fox jumps over the lazy dog and keeps running far away" for i in range(6)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-6h3kv"), hidden_size=96, num_heads=6, num_kv_heads=3)


@pytest.fixture(scope="module")
def offline(model_dir) -> list[list[int]]:
    llm = LLM(model_dir, progress=False, kv_cache_memory_bytes=32 << 20)
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def _start(model_dir: str, prefill_tp: int, decode_tp: int, num_decode: int, tmp_path_factory):
    ports = {"router": free_port_range(1), "kvstore": free_port_range(1),
             "workers": free_port_range(1 + num_decode), "metrics": free_port_range(2 + num_decode + 1)}
    cmd = [sys.executable, "-m", "cli.main", "up", "--model", model_dir, "--prefill", "1", "--decode", str(num_decode),
           "--port", str(ports["router"]), "--kvstore-port", str(ports["kvstore"]), "--http-port", "off",
           "--worker-base-port", str(ports["workers"]), "--metrics-base-port", str(ports["metrics"]),
           "--path-policy", "threshold", "--short-prompt-tokens", "8",
           "--prefill-tensor-parallel-size", str(prefill_tp), "--decode-tensor-parallel-size", str(decode_tp),
           "--worker-args", "--kv-cache-memory-bytes 33554432 --collective-timeout-s 20"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=dict(os.environ, PDSERVE_LOG_LEVEL="WARNING"))
    up = Platform(proc, ports)
    up.wait_for("pdserve is up", timeout_s=300)
    return up


def _stop(up: Platform, tmp_path_factory, name: str) -> None:
    up.proc.send_signal(signal.SIGINT)
    try:
        up.proc.wait(timeout=90)
    finally:
        if up.proc.poll() is None:
            up.proc.kill()
        (tmp_path_factory.mktemp(name) / "pdserve-up.log").write_text("".join(up.lines))
    left = subprocess.run(["pgrep", "-s", str(up.proc.pid)], capture_output=True, text=True).stdout.split()
    assert left == [], f"processes left behind (rank processes included): {left}"


def _generate(up: Platform, prompt: str) -> list[int]:
    with RouterClient(up.router) as client:
        generation = client.generate_text(prompt, GREEDY, timeout_s=120)
    assert generation.finish_reason == "length", generation
    return generation.token_ids


def _run_all(up: Platform, during=None) -> list[list[int]]:
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(_generate, up, p) for p in PROMPTS]
        if during is not None:
            futures[0].result(timeout=120)
            during()
        return [f.result(timeout=240) for f in futures]


def test_prefill_t3_hands_off_to_decode_t1(model_dir, offline, tmp_path_factory):
    up = _start(model_dir, prefill_tp=3, decode_tp=1, num_decode=1, tmp_path_factory=tmp_path_factory)
    try:
        assert _run_all(up) == offline
        assert up.metric(1, "pdserve_worker_requests_total", '{outcome="ok"}') >= len(PROMPTS)  # prefilled there
    finally:
        _stop(up, tmp_path_factory, "up-p3-d1")


def test_prefill_t1_hands_off_to_decode_t3_and_a_killed_rank_takes_its_worker_down(model_dir, offline,
                                                                                     tmp_path_factory):
    up = _start(model_dir, prefill_tp=1, decode_tp=3, num_decode=2, tmp_path_factory=tmp_path_factory)
    try:
        assert _run_all(up) == offline
        decode_pid = up.pid("decode-0")
        ranks = subprocess.run(["pgrep", "-P", str(decode_pid)], capture_output=True, text=True).stdout.split()
        assert len(ranks) == 2, f"decode-0 should run 2 rank processes besides its own, found {ranks}"
        since = up.mark()
        killed = []
        # the streams in flight then are taken over by the other decode worker (or retried)
        assert _run_all(up, during=lambda: killed.append(os.kill(int(ranks[0]), signal.SIGKILL))) == offline
        up.wait_for(rf"rank \d \(pid {ranks[0]}\) was killed by SIGKILL", 30, since)
        up.wait_for(r"decode-0 exited \(code 1", 30, since)
        up.wait_for("decode-0 serving again", 240, since)
        assert _run_all(up) == offline
    finally:
        _stop(up, tmp_path_factory, "up-p1-d3")
