"""Decode workers dying under running streams, seeded sampling on every path, and a kvstore
that is down: real decode worker processes (kill -9), the router, a prefill worker and the
kvstore in this process, all on the tiny model.

The tests run in file order over one module cluster: seeded paths first (both decode
workers up), then one decode worker killed under load, then the kvstore stopped, then the
last decode worker killed.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from pdserve.cli.bench.local_platform import free_port
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.services.kvstore.server import KVStoreConfig
from pdserve.services.kvstore.server import serve as serve_kvstore
from pdserve.services.prefill.server import serve as serve_prefill
from pdserve.services.router.client import RouterClient
from pdserve.services.router.config import PathConfig, RouterConfig
from pdserve.services.router.server import serve as serve_router
from pdserve.services.router.state.discovery import DECODE
from pdserve.services.worker.config import WorkerConfig

SHORT = [list(range(300, 312)), list(range(400, 420)), [11, 12, 13]]     # direct: <= 32 tokens
LONG = [list(range(1000, 1080)), list(range(2000, 2070)), list(range(3000, 3100))]  # prefill -> kvstore -> decode
MAX_TOKENS = 96  # long enough that every stream is mid-way when a worker is killed
SEEDED = SamplingParams(temperature=1.0, seed=1234, max_tokens=MAX_TOKENS, ignore_eos=True)
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
# penalties over the output: a resumed request must count every token sent before the break
PENALISED = SamplingParams(temperature=1.0, seed=4321, max_tokens=MAX_TOKENS, ignore_eos=True, repetition_penalty=1.3,
                           frequency_penalty=0.8, presence_penalty=0.2, logit_bias={100: 12.0, 200: -100.0},
                           min_tokens=MAX_TOKENS)
# three completions of one prompt (n): completion i is seed + i, each resumed alone when its worker dies
SEEDED_N = dataclasses.replace(SEEDED, n=3)


def _free_port() -> int:
    return free_port()  # below the ephemeral range: the decode process binds it seconds later


def _start_decode(model: str, kvstore: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli.main", "decode", "--model", model, "--port", str(port),
                             "--kvstore", kvstore, "--threads", "1", "--kv-cache-memory-bytes", str(8 << 20)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    return proc, f"127.0.0.1:{port}"


def _wait_until(condition, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for: {what}")
        time.sleep(0.02)


class _Cluster:
    def __init__(self, model: str, loaded):
        self.kvstore = serve_kvstore(KVStoreConfig(capacity_bytes=64 << 20, metrics_port=None))
        self.kvstore_stopped = False
        self.decodes = [_start_decode(model, self.kvstore.address) for _ in range(2)]
        self.prefill = self.router = None
        self.offline: dict = {}
        try:
            engine = EngineConfig(model=model, cache=CacheConfig(kv_cache_memory_bytes=8 << 20))
            self.prefill = serve_prefill(WorkerConfig(engine=engine, kvstore_address=self.kvstore.address), loaded)
            self.router = serve_router(RouterConfig(
                model=model, prefill_addresses=(self.prefill.address,),
                decode_addresses=tuple(address for _, address in self.decodes),
                kvstore_address=self.kvstore.address, paths=PathConfig(policy="threshold"), short_prompt_tokens=32,
                port=0, metrics_port=None, poll_interval_s=0.1, poll_timeout_s=0.5))
        except Exception:
            self.stop()
            raise

    def decodes_up(self) -> int:
        return sum(v.up for v in self.router.registry.views(DECODE))

    def metric(self, name: str, **labels) -> float:
        return self.router.metrics.metrics.value(name, labels)

    def prefilled_tokens(self) -> float:
        return self.prefill.servicer.metrics.prompt_tokens._value.get()

    def kill_decode(self, address: str) -> None:
        proc = next(p for p, a in self.decodes if a == address)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)

    def stop(self) -> None:
        if self.router is not None:
            self.router.stop(grace_s=0)
        for proc, _ in self.decodes:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        if self.prefill is not None:
            self.prefill.stop()
        if not self.kvstore_stopped:
            self.kvstore.stop()


@pytest.fixture(scope="module")
def cluster(tiny, tiny_llama_dir):
    c = _Cluster(tiny_llama_dir, tiny)
    try:
        c.offline = _offline(tiny, tiny_llama_dir)  # while the decode worker processes start
        _wait_until(lambda: c.decodes_up() == 2, "both decode worker processes serving")
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def offline(cluster):
    return cluster.offline


def _offline(tiny, model: str) -> dict:
    """The uninterrupted runs: the offline engine, greedy, seeded and penalised, every prompt."""
    llm = LLM(model, loaded_model=tiny, progress=False)
    prompts = [{"prompt_token_ids": p} for p in SHORT + LONG]
    seeded_n = [dataclasses.replace(SEEDED, seed=SEEDED.seed + i) for i in range(1, SEEDED_N.n)]
    return {(tuple(p), params.seed): out
            for params in (GREEDY, SEEDED, PENALISED, *seeded_n)
            for p, out in zip(SHORT + LONG, llm.generate(prompts, params))}


def _run(address: str, prompt, params, on_token=lambda: None):
    """(tokens, text, final message); with n > 1, a list of them by completion index."""
    tokens, text, final = [[] for _ in range(params.n)], [[] for _ in range(params.n)], [None] * params.n
    with RouterClient(address) as client:
        for msg in client.generate(prompt, params, timeout_s=120):
            tokens[msg.index].extend(msg.token_ids)
            text[msg.index].append(msg.text)
            final[msg.index] = msg
            on_token()
    if params.n == 1:
        return tokens[0], "".join(text[0]), final[0]
    return list(zip(tokens, ["".join(t) for t in text], final))


def test_seeded_sampling_is_the_same_offline_direct_and_disaggregated(cluster, offline):
    # direct: one decode worker samples every token (a colocated request); disaggregated: the
    # prefill worker samples the first, a decode worker the rest
    for prompt in (SHORT[0], LONG[0]):
        tokens, text, final = _run(cluster.router.address, prompt, SEEDED)
        expected = offline[(tuple(prompt), SEEDED.seed)]
        assert tokens == expected.token_ids and text == expected.text
        assert final.path == ("direct" if prompt is SHORT[0] else "disaggregated")
    assert tokens != offline[(tuple(LONG[0]), None)].token_ids  # (seeded is not greedy here)


def test_killing_a_decode_worker_mid_stream_resumes_every_stream_exactly(cluster, offline):
    runs = [(p, GREEDY) for p in SHORT + LONG] + [(SHORT[1], SEEDED), (LONG[1], SEEDED)] + [
        (SHORT[2], PENALISED), (LONG[2], PENALISED)] + [(SHORT[0], SEEDED_N), (LONG[0], SEEDED_N)]
    received = [0] * len(runs)

    def run(i):
        def count():
            received[i] += 1
        return _run(cluster.router.address, runs[i][0], runs[i][1], count)
    with ThreadPoolExecutor(len(runs)) as pool:
        futures = [pool.submit(run, i) for i in range(len(runs))]
        _wait_until(lambda: min(received) >= 3, "every stream under way", timeout_s=60)
        views = cluster.router.registry.views(DECODE)
        victim = max(views, key=lambda v: v.in_flight)
        assert victim.in_flight > 0
        cluster.kill_decode(victim.address)
        results = [f.result(timeout=120) for f in futures]
    for (prompt, params), result in zip(runs, results):
        for i, (tokens, text, final) in enumerate([result] if params.n == 1 else result):
            expected = offline[(tuple(prompt), None if params.seed is None else params.seed + i)]
            assert tokens == expected.token_ids  # nothing repeated, nothing dropped
            assert text == expected.text
            assert final.finish_reason == "length" and final.usage.completion_tokens == MAX_TOKENS
    # the stream's own error (unavailable) or, on a loaded machine, a poll that found the
    # worker gone first (worker_lost): either way the streams moved
    assert (cluster.metric("router_migrations_total", reason="unavailable")
            + cluster.metric("router_migrations_total", reason="worker_lost")) >= 1
    assert cluster.metric("router_requests_total", slo_class="interactive", outcome="ok") >= len(runs)


def test_kvstore_down_sends_long_prompts_direct(cluster, offline):
    cluster.kvstore.stop()
    cluster.kvstore_stopped = True
    _wait_until(lambda: not cluster.router.registry.kvstore.up, "the router saw the kvstore down", 10)
    prefilled = cluster.prefilled_tokens()
    tokens, text, final = _run(cluster.router.address, LONG[2], GREEDY)
    assert tokens == offline[(tuple(LONG[2]), None)].token_ids and final.path == "direct"
    assert cluster.prefilled_tokens() == prefilled  # prefilled once, on the decode worker
    assert cluster.metric("router_path_decisions_total", path="direct", reason="kvstore_down") == 1


def test_with_no_decode_worker_left_a_request_fails_fast_unprefilled(cluster):
    (last,) = [v.address for v in cluster.router.registry.views(DECODE) if v.up]
    prefilled = cluster.prefilled_tokens()
    start = time.monotonic()
    cluster.kill_decode(last)
    _wait_until(lambda: cluster.decodes_up() == 0, "the router saw the worker gone", 2)
    with pytest.raises(grpc.RpcError) as e:
        _run(cluster.router.address, LONG[1], GREEDY)
    assert time.monotonic() - start < 2.0
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "no decode worker" in e.value.details()
    assert cluster.prefilled_tokens() == prefilled
