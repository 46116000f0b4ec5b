"""Issue 49 on a real cluster (loopback sockets, one process): workers holding the
platform's token seal and encrypt every block they write. A process that reads the
kvstore finds no plain KV row of a prompt; a block it forges with every check it can
compute (the unkeyed checksum) is refused by both readers (`seal`), counted, and the
answer stays the offline engine's. Each attack has its control: with the defence patched
out of the workers in the test, the same read finds the rows and the same forgery is
imported and changes the answer."""
from __future__ import annotations

import numpy as np
import pytest

from pdserve.engine import LLM, SamplingParams
from tests.services.cluster import start_cluster
from tests.services.security.test_kv_poisoning import _generate, _real_block, _rejected
from tests.services.test_disaggregated import MAX_TOKENS, assert_nothing_leaked

PROMPTS = {name: list(range(base, base + 70)) for name, base in
           (("read", 7000), ("read-control", 7100), ("forged", 7200), ("forged-control", 7300))}


@pytest.fixture(scope="module")
def offline(tiny, tiny_llama_dir):
    llm = LLM(tiny_llama_dir, loaded_model=tiny, progress=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS.values()],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    return {name: o.token_ids for name, o in zip(PROMPTS, outs)}


@pytest.fixture(scope="module")
def cluster(tiny, tiny_llama_dir):
    c = start_cluster(tiny_llama_dir, tiny, num_prefill=1, num_decode=1, kv_token="sealed-platform-token",
                      kv_write_finished=False)
    yield c
    try:
        assert_nothing_leaked(c)
    finally:
        c.stop()


@pytest.fixture
def unsealed(cluster):
    """The throwaway patch: the workers write and read as if they had no token."""
    workers = cluster.workers()
    keys = [w.servicer.kv_keys for w in workers]
    for w in workers:
        w.servicer.kv_keys = None
    yield
    for w, k in zip(workers, keys):
        w.servicer.kv_keys = k


def _plain_rows(worker, prompt, salt) -> list[bytes]:
    """The prompt's full blocks as this worker's cache holds them, cut into 32-byte rows."""
    hashes = worker.loop.info.prompt_block_hashes(prompt, salt)
    payload = worker.loop.call(lambda engine: engine.export_cached_blocks(hashes)).result()
    flat = payload.blocks.contiguous().numpy().view(np.uint8).reshape(-1)
    return [bytes(flat[i:i + 32]) for i in range(0, len(flat), 32)]


def _store_bytes(cluster, worker, prompt, salt) -> bytes:
    """Everything the kvstore hands a caller for the prompt's blocks: what a reader of the
    plane gets (it lists the names; here the test names them)."""
    hashes = worker.loop.info.prompt_block_hashes(prompt, salt)
    blocks = cluster.kvstore_client().get(hashes)
    assert sum(b.found for b in blocks) == 4
    return b"".join(b.data for b in blocks)


def _found_rows(cluster, name, salt) -> int:
    prefill = cluster.prefills[0]
    rows = _plain_rows(prefill, PROMPTS[name], salt)
    stored = _store_bytes(cluster, prefill, PROMPTS[name], salt)
    return sum(row in stored for row in rows if any(row))


def test_the_store_holds_no_plain_row_of_a_salted_prompt(cluster, offline):
    assert _generate(cluster, PROMPTS["read"], cache_salt="tenant-a") == offline["read"]
    assert _found_rows(cluster, "read", "tenant-a") == 0


def test_control_without_the_seal_the_store_holds_the_prompts_rows(cluster, offline, unsealed):
    assert _generate(cluster, PROMPTS["read-control"], cache_salt="tenant-a") == offline["read-control"]
    assert _found_rows(cluster, "read-control", "tenant-a") > 100


def _forge(cluster, name) -> None:
    """A block of the right layout, sealed with the unkeyed checksum, under the prompt's
    first block name, in the store before the prompt is ever sent."""
    decode = cluster.decodes[0]
    hashes = decode.loop.info.prompt_block_hashes(PROMPTS[name])
    assert cluster.kvstore_client().put([_real_block(decode, hashes[0], fill=3.0)]) == 1


def test_a_forged_block_is_refused_by_both_readers_and_the_answer_is_exact(cluster, offline):
    prefill, decode = cluster.prefills[0], cluster.decodes[0]
    _forge(cluster, "forged")
    before = _rejected(prefill, "seal"), _rejected(decode, "seal")
    assert _generate(cluster, PROMPTS["forged"]) == offline["forged"]
    assert (_rejected(prefill, "seal"), _rejected(decode, "seal")) == (before[0] + 1, before[1] + 1)


def test_control_without_the_seal_the_forged_block_is_imported_and_changes_the_answer(cluster, offline,
                                                                                        unsealed):
    decode = cluster.decodes[0]
    _forge(cluster, "forged-control")
    imported = decode.servicer.metrics.kvstore_imported._value.get()
    assert _generate(cluster, PROMPTS["forged-control"]) != offline["forged-control"]
    assert decode.servicer.metrics.kvstore_imported._value.get() > imported
