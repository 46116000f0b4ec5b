"""`pdserve up --routers 2` (issue 49): two routers share the pools. kill -9 of the one
serving 8 gRPC streams through pdserve's RouterClient, given both: every stream goes on at
the other after the tokens it had (GenerateRequest.resume_token_ids) and ends token-exact
with the offline engine. An HTTP stream (the OpenAI client) cut by its router's death ends
with an error the client sees, never as a clean end of stream. The supervisor restarts
the killed router and it serves again.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from pdserve.cli.bench.local_platform import free_port_range
from pdserve.engine import SamplingParams
from pdserve.services.router.client import RouterClient
from tests.cli.up_platform import running_up

MAX_TOKENS = 160  # long enough that every stream is mid-way when its router is killed
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=5, ignore_eos=True)
PROMPTS = [f"stream {i}: the quick brown fox jumps over the lazy dog and runs far away" for i in range(8)]


@pytest.fixture(scope="module")
def platform(tiny_llama_dir, tmp_path_factory):
    ports = {"router": free_port_range(2), "kvstore": free_port_range(1), "workers": free_port_range(2),
             "metrics": free_port_range(5), "http": free_port_range(2)}
    args = ["--prefill", "1", "--decode", "1", "--routers", "2", "--path-policy", "threshold",
            "--short-prompt-tokens", "8"]
    with running_up(tiny_llama_dir, ports, args, tmp_path_factory.mktemp("up-routers")) as up:
        up.routers = [f"127.0.0.1:{ports['router']}", f"127.0.0.1:{ports['router'] + 1}"]
        up.http = [f"http://127.0.0.1:{ports['http'] + i}/v1" for i in range(2)]
        yield up


@pytest.fixture(scope="module")
def reference(tiny, tiny_llama_dir) -> dict[str, list[list[int]]]:
    from pdserve.engine import LLM
    offline = LLM(tiny_llama_dir, loaded_model=tiny, progress=False, kv_cache_memory_bytes=64 << 20)
    return {name: [o.token_ids for o in offline.generate(PROMPTS, sampling)]
            for name, sampling in (("greedy", GREEDY), ("seeded", SEEDED))}


def _serving_again(platform, name: str, since: int) -> None:
    platform.wait_for(rf"{name} exited \(code -9, killed by SIGKILL\).*restarting", 10, since)
    platform.wait_for(f"{name} serving again", 120, since)


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_streams_cut_by_a_routers_death_finish_token_exact_on_the_other(platform, reference, sampling):
    params = GREEDY if sampling == "greedy" else SEEDED
    started = threading.Barrier(len(PROMPTS) + 1)
    client = RouterClient(platform.routers)  # one client, its streams on the first router

    def run(prompt: str) -> tuple[list[int], int]:
        stream = client.generate(prompt, params, timeout_s=120)
        tokens = []
        for msg in stream:
            tokens.extend(msg.token_ids)
            if len(tokens) == 2:
                started.wait(timeout=60)  # every stream has tokens: the router may die now
        return tokens, stream.num_resumes

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [pool.submit(run, p) for p in PROMPTS]
        started.wait(timeout=60)
        since = platform.mark()
        os.kill(platform.pid("router"), signal.SIGKILL)
        results = [f.result(timeout=180) for f in futures]
    client.close()
    assert [tokens for tokens, _ in results] == reference[sampling]
    assert sum(resumes for _, resumes in results) >= 1  # streams went on at router-1 after the tokens they had
    _serving_again(platform, "router", since)


def test_an_http_stream_cut_by_its_routers_death_ends_with_an_error(platform, tiny_llama_dir):
    import openai
    client = openai.OpenAI(base_url=platform.http[1], api_key="none", max_retries=0)
    stream = client.completions.create(model=tiny_llama_dir, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.0,
                                       stream=True, extra_body={"ignore_eos": True})
    received, since = 0, None
    with pytest.raises(Exception) as err:  # whatever the client library calls it: not a clean end
        for _ in stream:
            received += 1
            if received == 3:
                since = platform.mark()
                os.kill(platform.pid("router-1"), signal.SIGKILL)
    assert 3 <= received < MAX_TOKENS
    assert isinstance(err.value, (openai.APIConnectionError, ConnectionError)) or "incomplete" in str(err.value) \
        or "closed" in str(err.value), repr(err.value)
    _serving_again(platform, "router-1", since)
    time.sleep(0.5)
    with RouterClient(platform.routers[1]) as again:
        assert len(again.generate_text(PROMPTS[1], GREEDY, timeout_s=60).token_ids) == MAX_TOKENS
