"""Issue 49 on a real cluster (loopback sockets, one process): workers holding the
platform's token seal and encrypt every block they write. A process that reads the
kvstore finds no plain KV row of a prompt; a block it forges with every check it can
compute (the unkeyed checksum) is refused by both readers (`seal`), counted, and the
answer stays the offline engine's; so are block files forged in the disk tier, found by
a kvstore restarted on the folder. Each attack has its control: with the defence patched
out of the workers in the test, the same read finds the rows and the same forgery is
imported and changes the answer."""
from __future__ import annotations

import time

import numpy as np
import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.services.kvstore.stores import disk_files
from pdserve.services.pb import kvstore_pb2 as pb
from pdserve.services.worker import kv_integrity
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


# ---- the disk tier: files replaced by someone who can write the folder -----------------

DISK_PROMPT = list(range(7400, 7470))


def _block_files(folder) -> list:
    return sorted(p for p in folder.iterdir() if p.name.endswith(disk_files.SUFFIX))


def _forge_files(folder) -> int:
    """Every block file rewritten whole: plausible KV, the header's seal dropped and its
    unkeyed checksum (XXH3, computable by anyone) set, the file's crc32 right."""
    gen = np.random.default_rng(3)
    files = _block_files(folder)
    for path in files:
        key = bytes.fromhex(path.name[:-len(disk_files.SUFFIX)])
        with open(path, "rb") as f:
            block = disk_files.read_block(f, key)
        header = pb.KVBlockHeader.FromString(block.header)
        header.ClearField("seal")
        data = gen.standard_normal(len(block.data) // 4, dtype=np.float32).tobytes()
        forged = disk_files.StoredBlock(key, kv_integrity.seal(header, data).SerializeToString(), data)
        path.write_bytes(disk_files.encode_prefix(forged) + forged.key + forged.header + forged.data)
    return len(files)


@pytest.fixture(scope="module")
def forged_disk(tiny, tiny_llama_dir, tmp_path_factory):
    """A disk tier the prompt's blocks were written to by a sealed platform, then stopped,
    its files forged: the folder a restarted kvstore reloads."""
    folder = tmp_path_factory.mktemp("disk") / "blocks"
    writer = start_cluster(tiny_llama_dir, tiny, num_prefill=1, num_decode=1, kv_token="disk-platform-token",
                           kvstore_disk_dir=str(folder), kv_write_finished=False)
    try:
        _generate(writer, DISK_PROMPT, cache_salt="tenant-a")
        deadline = time.monotonic() + 10
        while len(_block_files(folder)) < 4:  # the disk tier writes behind a queue
            assert time.monotonic() < deadline, "the disk tier did not write the prompt's blocks"
            time.sleep(0.05)
    finally:
        writer.stop()
    assert _forge_files(folder) >= 4
    return folder


def _restarted(tiny, tiny_llama_dir, folder):
    """A kvstore restarted on the folder, with fresh workers (nothing in their own caches)."""
    return start_cluster(tiny_llama_dir, tiny, num_prefill=1, num_decode=1, kv_token="disk-platform-token",
                         kvstore_disk_dir=str(folder), kv_write_finished=False)


def test_forged_disk_files_are_refused_at_reload_and_the_answer_is_exact(tiny, tiny_llama_dir, forged_disk,
                                                                         offline_disk):
    c = _restarted(tiny, tiny_llama_dir, forged_disk)
    try:
        prefill = c.prefills[0]
        assert c.kvstore_client().lookup(prefill.loop.info.prompt_block_hashes(DISK_PROMPT, "tenant-a")) == 4
        assert _generate(c, DISK_PROMPT, cache_salt="tenant-a") == offline_disk
        assert _rejected(prefill, "seal") == 1  # the first forged block ends the prefix: all recomputed
        assert prefill.servicer.metrics.kvstore_imported._value.get() == 0
    finally:
        c.stop()


def test_control_without_the_seal_the_forged_disk_files_are_imported(tiny, tiny_llama_dir, forged_disk,
                                                                       offline_disk):
    c = _restarted(tiny, tiny_llama_dir, forged_disk)
    try:
        for w in c.workers():  # the throwaway patch: these workers neither seal nor check seals
            w.servicer.kv_keys = None
        prefill = c.prefills[0]
        assert _generate(c, DISK_PROMPT, cache_salt="tenant-a") != offline_disk
        assert prefill.servicer.metrics.kvstore_imported._value.get() >= 4 * 16
    finally:
        c.stop()


@pytest.fixture(scope="module")
def offline_disk(tiny, tiny_llama_dir):
    llm = LLM(tiny_llama_dir, loaded_model=tiny, progress=False)
    return llm.generate({"prompt_token_ids": DISK_PROMPT}, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))[0].token_ids
