"""Two turns of a conversation through `pdserve up` as processes, the KV bytes on the
Mooncake data plane: the decode worker writes turn 1's prompt + answer when it finishes,
and turn 2's prefill imports the answer's blocks from the store (it never computed them).
Token ids throughout (turn 2 = turn 1's prompt + its output + new ids), token-exact with
the offline engine. The in-process variants over gRPC and UCX:
tests/services/test_finished_kv_e2e.py."""
from __future__ import annotations

import time

import pytest

from pdserve.cli.bench.local_platform import free_port_range
from pdserve.engine import LLM, SamplingParams
from pdserve.services.router.client import RouterClient
from tests.cli.up_platform import Platform, running_up, scrape, up_ports

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
PROMPT1 = list(range(1000, 1100))  # 100 tokens: over --short-prompt-tokens, through the prefill
NEW = list(range(700, 710))


@pytest.fixture(scope="module")
def platform(tiny_llama_dir, tmp_path_factory):
    args = ["--prefill", "1", "--decode", "1", "--path-policy", "threshold", "--short-prompt-tokens", "8",
            "--kvstore-backend", "mooncake", "--kvstore-replicas", "1", "--kvstore-capacity-bytes", "64MiB",
            "--mooncake-base-port", str(free_port_range(7))]
    with running_up(tiny_llama_dir, up_ports(2), args, tmp_path_factory.mktemp("up-multi-turn")) as up:
        yield up


def _generate(platform: Platform, prompt: list[int]) -> list[int]:
    with RouterClient(platform.router) as client:
        return client.generate_text(prompt, GREEDY, timeout_s=120).token_ids


def _metric(platform: Platform, process: str, name: str, labels: str = "") -> float:
    return scrape(platform.metrics_url(process), name, labels)


def test_the_next_turn_imports_the_answer_the_decode_wrote(platform, tiny, tiny_llama_dir):
    offline = LLM(tiny_llama_dir, loaded_model=tiny, progress=False)
    output1 = _generate(platform, PROMPT1)
    assert output1 == offline.generate({"prompt_token_ids": PROMPT1}, GREEDY)[0].token_ids
    # 139 tokens with KV: 8 full blocks; the prefill wrote the prompt's 6, the decode the answer's 2
    deadline = time.monotonic() + 60
    while _metric(platform, "decode-0", "pdserve_kv_finished_written_blocks_total") < 2:
        assert time.monotonic() < deadline, platform.log()
        time.sleep(0.2)
    assert _metric(platform, "decode-0", "pdserve_kv_finished_skipped_blocks_total", '{reason="in_store"}') == 6
    imported = _metric(platform, "prefill-0", "pdserve_kvstore_imported_tokens_total")
    prompt2 = PROMPT1 + output1 + NEW
    assert _generate(platform, prompt2) == offline.generate({"prompt_token_ids": prompt2}, GREEDY)[0].token_ids
    # the prefill holds the prompt's 6 blocks itself: it reads from the store only the answer's 2
    assert _metric(platform, "prefill-0", "pdserve_kvstore_imported_tokens_total") - imported == 2 * 16
    kvstore = platform.metrics_url("kvstore")
    assert scrape(kvstore, "pdserve_kvstore_put_bytes_total", '{transport="mooncake"}') > 0
