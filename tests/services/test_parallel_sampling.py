"""GenerateRequest.n through the router (services/router/core/choices.py): the prompt
prefilled once on a prefill worker (its KV written once, under one lease shared by the n
decodes), or once on a decode worker on the direct path; completion i equals a single
request with seed + i on the offline engine; nothing leaked."""
from __future__ import annotations

import dataclasses

import grpc
import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.services.common.convert import sampling_to_proto
from pdserve.services.common.grpc_server import channel
from pdserve.services.pb import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc, router_pb2, router_pb2_grpc
from pdserve.services.router.client import RouterClient
from tests.services.cluster import start_cluster
from tests.services.test_disaggregated import assert_nothing_leaked

LONG = list(range(1000, 1070))  # 70 tokens: through the prefill pool (the cluster's threshold is 32)
SHORT = list(range(300, 320))   # 20 tokens: direct
SEEDED = SamplingParams(temperature=0.8, seed=77, max_tokens=10, ignore_eos=True)


def assert_siblings_read_one_handle(num_imported: float, n: int, num_prompt_tokens: int, block_size: int = 16) -> None:
    """The n sibling decodes of one prompt all read its KV from the kvstore: each reads the
    tail (never a full block, so never in a prefix cache); the full blocks are read by the
    first, and by a later sibling unless an earlier one's import already put them in the
    decode worker's prefix cache, which depends on timing."""
    full = num_prompt_tokens // block_size * block_size
    num_full_reads, rest = divmod(num_imported - n * (num_prompt_tokens - full), full)
    assert rest == 0 and 1 <= num_full_reads <= n, num_imported


@pytest.fixture(scope="module")
def offline(tiny, tiny_llama_dir):
    llm = LLM(tiny_llama_dir, loaded_model=tiny, progress=False)

    def run(prompt, params: SamplingParams, n: int) -> list[list[int]]:
        seeds = [None] * n if params.seed is None else [params.seed + i for i in range(n)]
        return [llm.generate({"prompt_token_ids": prompt}, dataclasses.replace(params, seed=s))[0].token_ids
                for s in seeds]
    return run


@pytest.fixture(scope="module")
def cluster(tiny, tiny_llama_dir):
    c = start_cluster(tiny_llama_dir, tiny, num_prefill=1, num_decode=2)
    yield c
    c.stop()


def _completions(cluster, prompt, params: SamplingParams) -> tuple[list[list[int]], list]:
    """Each completion's tokens by index, and its final message."""
    tokens = [[] for _ in range(params.n)]
    finals = [None] * params.n
    with RouterClient(cluster.router.address) as client:
        for msg in client.generate(prompt, params, timeout_s=120):
            assert finals[msg.index] is None  # nothing after a completion's final message
            tokens[msg.index].extend(msg.token_ids)
            if msg.finish_reason:
                finals[msg.index] = msg
    return tokens, finals


def _counter(workers, name: str) -> float:
    return sum(w.servicer.metrics.metrics.value(name, {}) for w in workers)


def _reused(decodes) -> float:
    """Prompt tokens the decodes did not compute: imported from the kvstore, or found in
    their own prefix cache (which a read skips)."""
    return _counter(decodes, "kvstore_imported_tokens_total") + sum(d.loop.stats.num_prefix_hit_tokens
                                                                    for d in decodes)


def test_disaggregated_prefills_once_and_every_decode_reads_the_one_handle(cluster, offline):
    prefilled, imported = _counter(cluster.prefills, "prefill_tokens_total"), _counter(cluster.decodes,
                                                                                       "kvstore_imported_tokens_total")
    hits = cluster.prefills[0].loop.stats.num_prefix_hit_tokens
    params = dataclasses.replace(SEEDED, n=4)
    tokens, finals = _completions(cluster, LONG, params)
    assert tokens == offline(LONG, SEEDED, 4)
    assert len({tuple(t) for t in tokens}) > 1
    assert {f.path for f in finals} == {"disaggregated"}
    assert [f.usage.completion_tokens for f in finals] == [10] * 4
    assert {f.usage.prompt_tokens for f in finals} == {len(LONG)}
    assert _counter(cluster.prefills, "prefill_tokens_total") - prefilled == len(LONG)  # once, not 4 times
    # the three siblings on the prefill worker hit the first's full blocks (the last token is computed)
    assert cluster.prefills[0].loop.stats.num_prefix_hit_tokens - hits == 3 * ((len(LONG) - 1) // 16 * 16)
    # every decode read the prompt's KV, tail included: the lease held until the fourth read
    assert_siblings_read_one_handle(_counter(cluster.decodes, "kvstore_imported_tokens_total") - imported, 4, len(LONG))
    assert_nothing_leaked(cluster)


def test_direct_path_prefills_once_on_the_decode_worker(cluster, offline):
    prefilled = _counter(cluster.decodes, "prefill_tokens_total")
    tokens, finals = _completions(cluster, SHORT, dataclasses.replace(SEEDED, n=3))
    assert tokens == offline(SHORT, SEEDED, 3)
    assert {f.path for f in finals} == {"direct"}
    assert _counter(cluster.decodes, "prefill_tokens_total") - prefilled == len(SHORT)
    assert_nothing_leaked(cluster)


def test_greedy_completions_are_identical(cluster, offline):
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, n=3)
    for prompt in (LONG, SHORT):
        tokens, _ = _completions(cluster, prompt, greedy)
        assert tokens == offline(prompt, greedy, 1) * 3
    assert_nothing_leaked(cluster)


def test_completions_ending_at_the_first_token_need_no_decode(cluster, offline):
    one = dataclasses.replace(SEEDED, n=3, max_tokens=1)
    tokens, finals = _completions(cluster, LONG, one)
    assert tokens == offline(LONG, dataclasses.replace(SEEDED, max_tokens=1), 3)
    assert {f.finish_reason for f in finals} == {"length"}
    assert_nothing_leaked(cluster)


@pytest.mark.parametrize("n", [129, 1 << 20])
def test_n_is_bounded_naming_the_field(cluster, n):
    stub = router_pb2_grpc.RouterStub(channel(cluster.router.address))
    request = router_pb2.GenerateRequest(n=n)
    request.token_ids.ids.extend(SHORT)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(request, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("n: must be at most 128")


def test_decodes_sharing_a_lease_leave_it_to_the_router(cluster, offline):
    """The worker contracts alone, one call after the other (no race to hide a release):
    PrefillRequest.n gives n first tokens and one handle; each DecodeRequest with
    shared_lease reads all of it, tail included, and leaves the lease held."""
    prefill, decode = cluster.prefills[0], cluster.decodes[0]
    params = dataclasses.replace(SEEDED, n=3)
    with channel(prefill.address) as ch:
        reply = prefill_pb2_grpc.PrefillWorkerStub(ch).Prefill(prefill_pb2.PrefillRequest(
            req_id="shared", prompt_token_ids=LONG, sampling=sampling_to_proto(SEEDED), n=3))
    expected = offline(LONG, SEEDED, 3)
    assert [c.token_id for c in reply.choices] == [t[0] for t in expected]
    assert reply.choices[0].token_id == expected[0][0] and reply.kv_handle.num_tokens == len(LONG)
    reused = _reused(cluster.decodes)
    for i in range(params.n):
        child = sampling_to_proto(dataclasses.replace(SEEDED, seed=SEEDED.seed + i))
        with channel(decode.address) as ch:
            msgs = list(decode_pb2_grpc.DecodeWorkerStub(ch).Decode(decode_pb2.DecodeRequest(
                req_id=f"shared-{i}", prompt_token_ids=LONG, sampling=child, first_token_id=reply.choices[i].token_id,
                kv_handle=reply.kv_handle, shared_lease=True)))
        assert [t for m in msgs for t in m.token_ids] == expected[i][1:]
        # the first reads all of it; the next find its full blocks in the decode's cache and read the tail
        assert _reused(cluster.decodes) - reused == (i + 1) * len(LONG)
    assert cluster.kvstore_client().release_lease(reply.kv_handle.lease_id)  # still held: released here, once
    assert_nothing_leaked(cluster)

