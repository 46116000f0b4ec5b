"""`pdserve up --kvstore-backend mooncake --kvstore-replicas 2`: a Mooncake master and two
store nodes hold the KV bytes, the kvstore indexes them, prefill and decode move them
straight to and from the nodes (through the one on their host, by shared memory).
Token-exact with the offline engine through P/D, and under kill -9 of a store node
(nothing recomputed: the other replica serves) and of the master (recomputed, never
wrong; the supervisor brings it back and the plane is used again).

One platform serves the module; each test leaves it whole for the next.
"""
from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from pdserve.cli.bench.local_platform import free_port_range
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
            "--kvstore-backend", "mooncake", "--kvstore-replicas", "2", "--kvstore-capacity-bytes", "64MiB",
            "--mooncake-base-port", str(free_port_range(7))]
    with running_up(tiny_llama_dir, up_ports(2), args, tmp_path_factory.mktemp("up-mooncake")) as up:
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


def _run_all(platform: Platform, during=None) -> list[list[int]]:
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(_generate, platform.router, p) for p in PROMPTS]
        if during is not None:
            futures[0].result(timeout=90)  # the others are streaming now
            during()
        return [f.result(timeout=180) for f in futures]


def _mooncake_bytes(platform: Platform) -> tuple[float, float]:
    """What the kvstore indexed as moved through the plane: (put, get) bytes."""
    kvstore = platform.metrics_url("kvstore")
    return (scrape(kvstore, "pdserve_kvstore_put_bytes_total", '{transport="mooncake"}'),
            scrape(kvstore, "pdserve_kvstore_get_bytes_total", '{transport="mooncake"}'))


def _recomputed(platform: Platform) -> float:
    return scrape(platform.metrics_url("decode-0"), "pdserve_worker_recompute_fallbacks_total")


def _kill(platform: Platform, name: str) -> int:
    mark = platform.mark()
    os.kill(platform.pid(name), signal.SIGKILL)
    return mark


def test_through_mooncake_the_tokens_are_the_offline_engines(platform, reference):
    assert _run_all(platform) == reference
    put_bytes, get_bytes = _mooncake_bytes(platform)
    assert put_bytes > 0 and get_bytes > 0  # every hand-off went through the plane
    assert _recomputed(platform) == 0
    for worker in ("prefill-0", "decode-0"):  # beside the store nodes: through one of them, by shared memory
        with open(f"/proc/{platform.pid(worker)}/maps") as maps:
            assert "memfd:mooncake_shm" in maps.read(), worker
    master = platform.metrics_url("mooncake-master")
    assert scrape(master, "master_key_count") > 0
    assert scrape(master, "master_total_capacity_bytes") == 2 * 64 << 20  # both nodes' segments


def test_a_store_node_killed_under_load_loses_no_block(platform, reference):
    before = _recomputed(platform)
    marks = []
    assert _run_all(platform, during=lambda: marks.append(_kill(platform, "store-0"))) == reference
    assert _recomputed(platform) == before  # the other replica served every read
    platform.wait_for("store-0 serving again", 60, marks[0])
    assert _run_all(platform) == reference


def _local(platform: Platform, worker: str, name: str) -> float:
    return scrape(platform.metrics_url(worker), f"pdserve_worker_mooncake_local_{name}")


def test_a_store_node_killed_and_restarted_three_times_under_8_streams(platform, tiny, tiny_llama_dir):
    """The workers' local node (store-0) killed under 8 streams and restarted, three times
    in a row: every answer exact each time, and within seconds of each restart the decode
    worker has attached a fresh dummy client to it (local.py), its losses counted. New
    prompts each cycle: a prompt a worker's own cache holds moves no bytes."""
    from pdserve.engine import LLM
    offline = LLM(tiny_llama_dir, loaded_model=tiny, progress=False, kv_cache_memory_bytes=64 << 20)
    for cycle in range(3):
        prompts = [f"cycle {cycle} stream {i}: the quick brown fox jumps over the lazy dog and on" for i in range(8)]
        after = [f"cycle {cycle} after {i}: the lazy dog sleeps on while the fox runs far away" for i in range(3)]
        expected, expected_after = ([o.token_ids for o in offline.generate(p, GREEDY)] for p in (prompts, after))
        marks = []
        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(_generate, platform.router, p) for p in prompts]
            futures[0].result(timeout=90)
            marks.append(_kill(platform, "store-0"))
            assert [f.result(timeout=180) for f in futures] == expected
        platform.wait_for("store-0 serving again", 60, marks[0])
        # the first hand-off after the restart finds the node's restart (it fails there and
        # goes over TCP); from then on the worker attaches a fresh client within seconds
        assert _generate(platform.router, after[0]) == expected_after[0]
        deadline = time.monotonic() + 20
        while not (_local(platform, "decode-0", "node_up") == 1
                   and _local(platform, "decode-0", "node_losses_total") >= cycle + 1):
            assert time.monotonic() < deadline, f"cycle {cycle}: the decode worker did not attach to store-0 again"
            time.sleep(0.2)
        with ThreadPoolExecutor(2) as pool:
            assert list(pool.map(lambda p: _generate(platform.router, p), after[1:])) == expected_after[1:]
        # (whether those went through the node is not asserted here: in 2 of 9 cycles measured
        # a transfer after the re-attachment failed again and went over TCP, exact; the
        # transport's own test asserts it: test_mooncake_local.py; docs/kvstore.md)
    assert _local(platform, "decode-0", "node_losses_total") >= 3


def test_the_master_killed_means_recompute_never_wrong_tokens_then_the_plane_again(platform, reference):
    marks = []
    kvstore, master = platform.metrics_url("kvstore"), platform.metrics_url("mooncake-master")
    lost_before = scrape(kvstore, "pdserve_kvstore_blocks_lost_total")
    assert _run_all(platform, during=lambda: marks.append(_kill(platform, "mooncake-master"))) == reference
    platform.wait_for("mooncake-master serving again", 60, marks[0])
    # The index learns the restarted master lost what it held: it drops those blocks. Not
    # "the index is empty": a prompt prefilled after the restart legitimately put its blocks
    # through the new master (a full CI run saw that), so the index may name a few it has.
    deadline = time.monotonic() + 30
    while not (scrape(kvstore, "pdserve_kvstore_blocks_lost_total") > lost_before
               and scrape(kvstore, "pdserve_kvstore_blocks") <= scrape(master, "master_key_count")):
        assert time.monotonic() < deadline, (
            "the kvstore's index still names blocks the restarted master lost: "
            f"{scrape(kvstore, 'pdserve_kvstore_blocks')} indexed, {scrape(master, 'master_key_count')} on the master")
        time.sleep(0.5)
    while scrape(master, "master_total_capacity_bytes") != 2 * 64 << 20:  # both nodes mount again
        assert time.monotonic() < deadline + 30, "the store nodes did not mount on the restarted master"
        time.sleep(0.5)
    put_before, _ = _mooncake_bytes(platform)
    assert _run_all(platform) == reference
    # the restarted master places blocks again: the workers' clients find it on their own
    # (their first puts after the restart may still fail and go over TCP: exact, counted
    # elsewhere), so fresh prompts go in until one is put through the plane
    fresh = 0
    while _mooncake_bytes(platform)[0] <= put_before:
        assert time.monotonic() < deadline + 90, "no block went through the restarted master's plane"
        _generate(platform.router, f"after the restart {fresh}: " + PROMPTS[0])
        fresh += 1
        time.sleep(1.0)
