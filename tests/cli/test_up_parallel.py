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
from concurrent.futures import ThreadPoolExecutor

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.services.router.client import RouterClient
from tests.cli.up_platform import Platform, running_up, up_ports
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


def _platform(model_dir: str, prefill_tp: int, decode_tp: int, num_decode: int, log_dir):
    args = ["--prefill", "1", "--decode", str(num_decode), "--path-policy", "threshold", "--short-prompt-tokens", "8",
            "--prefill-tensor-parallel-size", str(prefill_tp), "--decode-tensor-parallel-size", str(decode_tp),
            "--worker-args", "--kv-cache-memory-bytes 33554432 --collective-timeout-s 20"]
    return running_up(model_dir, up_ports(1 + num_decode), args, log_dir, startup_timeout_s=300)


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
    with _platform(model_dir, 3, 1, 1, tmp_path_factory.mktemp("up-p3-d1")) as up:
        assert _run_all(up) == offline
        assert up.metric(1, "pdserve_worker_requests_total", '{outcome="ok"}') >= len(PROMPTS)  # prefilled there


def test_prefill_t1_hands_off_to_decode_t3_and_a_killed_rank_takes_its_worker_down(model_dir, offline,
                                                                                     tmp_path_factory):
    with _platform(model_dir, 1, 3, 2, tmp_path_factory.mktemp("up-p1-d3")) as up:
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
