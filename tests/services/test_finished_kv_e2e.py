"""Multi-turn through the platform: the decode worker writes a finished request's prompt +
answer to the kvstore, and the next turn's prefill finds the answer's blocks there.

Turn 2 is token ids: turn 1's prompt + turn 1's output + new ids (a chat template would
have to tokenize the answer the same way; that is the workload's business). It goes
through a prefill worker, which never held the answer's KV itself: what it imports from
the kvstore beyond turn 1's prompt blocks can only be the decode's write."""
from __future__ import annotations

import time

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.services.router.client import RouterClient
from pdserve.services.worker.finished_kv import NoFinishedKVWriter
from tests.services.cluster import start_cluster
from tests.services.test_disaggregated import assert_nothing_leaked

BS = 16
SHORT_PROMPT_TOKENS = 64  # at most this many prompt tokens go straight to a decode worker
PARAMS = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
NEW = list(range(700, 710))


@pytest.fixture
def cluster(tiny, tiny_llama_dir, request):
    """`request.param`: the KV transport (gRPC unless a test asks for another)."""
    c = start_cluster(tiny_llama_dir, tiny, num_prefill=1, num_decode=2, short_prompt_tokens=SHORT_PROMPT_TOKENS,
                      kvstore_transport=getattr(request, "param", "grpc"))
    yield c
    try:
        assert_nothing_leaked(c)
    finally:
        c.stop()


@pytest.fixture(scope="module")
def offline(tiny, tiny_llama_dir):
    llm = LLM(tiny_llama_dir, loaded_model=tiny, progress=False)
    return lambda prompt: llm.generate({"prompt_token_ids": prompt}, PARAMS)[0].token_ids


def _generate(c, prompt: list[int]):
    with RouterClient(c.router.address) as client:
        msgs = list(client.generate(prompt, PARAMS))
    return [t for m in msgs for t in m.token_ids], msgs[-1].path


def _value(counter) -> float:
    return counter._value.get()


def _written(c) -> float:
    return sum(_value(d.servicer.metrics.finished_kv_written_blocks) for d in c.decodes)


def _wait_for_written(c, num_blocks: int, timeout_s: float = 30.0) -> None:
    """The write runs after the response: wait until it is done (not a timing assertion)."""
    deadline = time.monotonic() + timeout_s
    while _written(c) < num_blocks and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _written(c) == num_blocks


def _skipped(c, reason: str) -> float:
    return sum(_value(d.servicer.metrics.finished_kv_skipped_blocks.labels(reason)) for d in c.decodes)


def _second_turn(c, offline, prompt1: list[int], output1: list[int], num_store_blocks: int) -> None:
    """Turn 2 through the prefill: it imports every block of prompt 1 + answer 1 the decode
    wrote (the answer's KV was never computed on it), and the tokens are the offline engine's."""
    prefill = c.prefills[0].servicer.metrics
    imported_before, hits_before = _value(prefill.kvstore_imported), c.kvstore_client().stats().num_hits
    local_before = c.prefills[0].loop.stats.num_prefix_hit_tokens
    prompt2 = prompt1 + output1 + NEW
    tokens2, path2 = _generate(c, prompt2)
    assert path2 == "disaggregated"
    assert tokens2 == offline(prompt2)
    imported = _value(prefill.kvstore_imported) - imported_before
    local = c.prefills[0].loop.stats.num_prefix_hit_tokens - local_before
    # the prefill reads only what follows its own prefix cache (turn 1's prompt, where it prefilled it)
    assert imported + local == num_store_blocks * BS and local <= (len(prompt1) // BS) * BS
    assert imported >= (num_store_blocks - len(prompt1) // BS) * BS > 0  # the answer's blocks, at least
    assert c.kvstore_client().stats().num_hits - hits_before >= imported // BS


@pytest.mark.parametrize("cluster", ["grpc", "ucx"], indirect=True)
def test_the_answer_of_a_disaggregated_turn_is_found_by_the_next(cluster, offline):
    prompt1 = list(range(1000, 1100))  # 100 tokens: through the prefill
    output1, path1 = _generate(cluster, prompt1)
    assert path1 == "disaggregated" and output1 == offline(prompt1)
    # 139 tokens with KV: 8 full blocks; the prefill wrote the prompt's 6, the decode imported
    # them and writes the answer's 2
    _wait_for_written(cluster, 2)
    assert _skipped(cluster, "in_store") == 6
    _second_turn(cluster, offline, prompt1, output1, num_store_blocks=8)


def test_the_whole_history_of_a_direct_turn_is_found_by_the_next(cluster, offline):
    prompt1 = list(range(3000, 3040))  # 40 tokens: prefilled by the decode worker itself
    output1, path1 = _generate(cluster, prompt1)
    assert path1 == "direct" and output1 == offline(prompt1)
    # 79 tokens with KV: 4 full blocks, none in the store yet
    _wait_for_written(cluster, 4)
    assert cluster.kvstore_client().stats().num_blocks == 4
    _second_turn(cluster, offline, prompt1, output1, num_store_blocks=4)
    # turn 2's decode writes its history past what the store holds: 90 + 40 tokens, 129 with
    # KV, 8 full blocks; the store has 5 (4 from turn 1, the 5th from turn 2's prefill)
    _wait_for_written(cluster, 4 + 3)


def test_off_writes_nothing(tiny, tiny_llama_dir, offline):
    c = start_cluster(tiny_llama_dir, tiny, num_prefill=0, num_decode=1, short_prompt_tokens=0,
                      kv_write_finished=False)
    try:
        prompt = list(range(3000, 3040))
        assert _generate(c, prompt)[0] == offline(prompt)
        assert isinstance(c.decodes[0].servicer.finished_kv, NoFinishedKVWriter)
        assert c.kvstore_client().stats().num_blocks == 0
    finally:
        c.stop()
