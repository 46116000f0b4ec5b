"""`pdserve up --both 2` as processes: two workers of both roles, each in both of the
router's pools. A long prompt is prefilled on one and decoded on the other, its KV through
the kvstore; a short one goes direct. Token-exact with the offline engine."""
from __future__ import annotations

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.services.router.client import RouterClient
from tests.cli.up_platform import Platform, running_up, scrape, up_ports

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
LONG = list(range(1000, 1100))   # 100 tokens, over --short-prompt-tokens: prefilled on one, decoded on the other
LONG2 = list(range(2000, 2070))  # 70 tokens, no prefix shared with LONG
SHORT = [5, 6, 7, 8, 9]          # direct
DECISIONS = "pdserve_router_path_decisions_total"


@pytest.fixture(scope="module")
def platform(tiny_llama_dir, tmp_path_factory):
    args = ["--both", "2", "--path-policy", "threshold", "--short-prompt-tokens", "8"]
    with running_up(tiny_llama_dir, up_ports(2), args, tmp_path_factory.mktemp("up-both")) as up:
        yield up


def _generate(platform: Platform, prompt: list[int]) -> list[int]:
    with RouterClient(platform.router) as client:
        return client.generate_text(prompt, GREEDY, timeout_s=120).token_ids


def test_both_workers_hand_long_prompts_to_each_other_and_take_short_ones_directly(platform, tiny, tiny_llama_dir):
    offline = LLM(tiny_llama_dir, loaded_model=tiny, progress=False)
    for prompt in (LONG, SHORT, LONG2):
        expected = offline.generate({"prompt_token_ids": prompt}, GREEDY)[0].token_ids
        assert _generate(platform, prompt) == expected, platform.log()
    router = platform.metrics_url("router")
    assert scrape(router, DECISIONS, '{path="disaggregated",reason="long_prompt"}') == 2
    assert scrape(router, DECISIONS, '{path="direct",reason="short_prompt"}') == 1
    # each long prompt's decode read its KV from the kvstore: the worker decoding it never
    # computed it (full blocks and the tail: 100 + 70 tokens at least)
    imported = sum(scrape(platform.metrics_url(w), "pdserve_kvstore_imported_tokens_total") for w in ("both-0", "both-1"))
    assert imported >= len(LONG) + len(LONG2)
