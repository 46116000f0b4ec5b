"""`pdserve up --kvstore-transport tcp`: the kvstore serves raw TCP frames on a free port,
every worker moves KV over it. Token-exact with the offline engine through P/D, the bytes
counted under transport "tcp", nothing recomputed; and after kill -9 of the kvstore (the
supervisor restarts it, on another free TCP port) the workers find the new port and move
KV over TCP again.

One platform serves the module; each test leaves it whole for the next.
"""
from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from pdserve.engine import SamplingParams
from pdserve.services.router.client import RouterClient
from tests.cli.up_platform import Platform, running_up, scrape, up_ports

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
# over --short-prompt-tokens: prefilled by the prefill worker, its KV read by the decode
PROMPTS = [f"turn {i}: the quick brown fox jumps over the lazy dog, then it runs on and on far away"
           for i in range(6)]


@pytest.fixture(scope="module")
def platform(tiny_llama_dir, tmp_path_factory):
    args = ["--prefill", "1", "--decode", "1", "--path-policy", "threshold", "--short-prompt-tokens", "8",
            "--kvstore-transport", "tcp", "--kvstore-capacity-bytes", "64MiB"]
    with running_up(tiny_llama_dir, up_ports(2), args, tmp_path_factory.mktemp("up-tcp")) as up:
        yield up


@pytest.fixture(scope="module")
def reference(tiny, tiny_llama_dir) -> list[list[int]]:
    from pdserve.engine import LLM
    offline = LLM(tiny_llama_dir, loaded_model=tiny, progress=False, kv_cache_memory_bytes=64 << 20)
    return [o.token_ids for o in offline.generate(PROMPTS, GREEDY)]


def _generate(address: str, prompt: str) -> list[int]:
    with RouterClient(address) as client:
        generation = client.generate_text(prompt, GREEDY, timeout_s=90)
    assert generation.finish_reason == "length", generation
    return generation.token_ids


def _run_all(platform: Platform) -> list[list[int]]:
    with ThreadPoolExecutor(3) as pool:
        return list(pool.map(lambda p: _generate(platform.router, p), PROMPTS))


def _tcp_bytes(platform: Platform) -> tuple[float, float]:
    """Block bytes the kvstore received and sent over TCP: (put, get)."""
    kvstore = platform.metrics_url("kvstore")
    return (scrape(kvstore, "pdserve_kvstore_put_bytes_total", '{transport="tcp"}'),
            scrape(kvstore, "pdserve_kvstore_get_bytes_total", '{transport="tcp"}'))


def _recomputed(platform: Platform) -> float:
    return scrape(platform.metrics_url("decode-0"), "pdserve_worker_recompute_fallbacks_total")


def test_over_tcp_the_tokens_are_the_offline_engines(platform, reference):
    assert _run_all(platform) == reference
    put_bytes, get_bytes = _tcp_bytes(platform)
    assert put_bytes > 0 and get_bytes > 0  # every hand-off went over the TCP port
    assert _recomputed(platform) == 0


def test_a_kvstore_killed_comes_back_on_another_port_and_the_workers_find_it(platform, reference):
    mark = platform.mark()
    os.kill(platform.pid("kvstore"), signal.SIGKILL)
    platform.wait_for("kvstore serving again", 60, mark)
    deadline = time.monotonic() + 60
    while _tcp_bytes(platform)[1] == 0:  # the new kvstore's counters start at 0
        assert time.monotonic() < deadline, "no KV read over TCP from the restarted kvstore"
        assert _run_all(platform) == reference  # recomputed while the workers reconnect, never wrong
    assert _run_all(platform) == reference
