"""KV cache poisoning (issue 14), on a real cluster over loopback sockets: the kvstore
refuses malformed and forged-layout blocks, a block whose bytes changed after its checksum
is refused at import and recomputed (same greedy tokens), salted requests share no KV with
other salts, and a decode worker reads only from the kvstore it was configured with."""
from __future__ import annotations

import grpc
import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.kv_transfer import KVLayout
from pdserve.services.common.grpc_server import channel
from pdserve.services.kvstore import batch_codec
from pdserve.services.pb import kvstore_pb2 as pb
from pdserve.services.router.client import RouterClient
from pdserve.services.worker.kv_wire import block_to_proto
from pdserve.services.pb import common_pb2
from tests.services.cluster import start_cluster
from tests.services.test_disaggregated import MAX_TOKENS, _decode_direct, _prefill_direct, _tokens, \
    assert_nothing_leaked

# 70 tokens: 4 full blocks of 16 and a tail of 6; each test its own prompt, so no test
# finds another's blocks in a prefix cache or the store
PROMPTS = {name: list(range(base, base + 70)) for name, base in
           (("checksum", 3000), ("salt", 4000), ("address", 5000), ("forged", 6000))}


@pytest.fixture(scope="module")
def llm(tiny, tiny_llama_dir):
    return LLM(tiny_llama_dir, loaded_model=tiny, progress=False)


@pytest.fixture(scope="module")
def offline(llm):
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS.values()],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    return {name: o.token_ids for name, o in zip(PROMPTS, outs)}


@pytest.fixture(scope="module")
def cluster(tiny, tiny_llama_dir):
    c = start_cluster(tiny_llama_dir, tiny, num_prefill=1, num_decode=1)
    yield c
    try:
        assert_nothing_leaked(c)
    finally:
        c.stop()


def _generate(cluster, prompt, cache_salt: str = "") -> list[int]:
    client = RouterClient(cluster.router.address)
    try:
        msgs = list(client.generate(prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                                    cache_salt=cache_salt))
    finally:
        client.close()
    assert msgs[-1].path == "disaggregated"
    return _tokens(msgs)


def _rejected(worker, reason: str) -> float:
    return worker.servicer.metrics.kv_blocks_rejected.labels(reason)._value.get()


def _hit_tokens(worker) -> int:
    return worker.loop.call(lambda engine: engine.kv_manager.num_hit_tokens).result()


def _real_block(worker, block_hash: bytes, fill: float = 0.5):
    """A block with this engine's exact layout, sealed, under `block_hash`: what a forger
    who knows the prompt (block hashes come from public facts) can build."""
    layout = worker.loop.info.kv_layout
    block = torch.full(layout.block_shape, fill, dtype=getattr(torch, layout.dtype))
    return block_to_proto(block, layout.block_size, block_hash=block_hash, model_id=layout.model_id)


def _malformed(worker, block_hash: bytes) -> list[tuple[str, object]]:
    """(the field the refusal must name, a change making a real block malformed)."""
    layout = worker.loop.info.kv_layout
    other = KVLayout.of(layout.model_id, "float16", layout.block_shape)

    def header(**fields):
        return lambda b: [setattr(b.header, k, v) for k, v in fields.items()]

    def shape(index, value):
        def change(b):
            b.header.shape[index] = value
        return change

    return [
        ("block_hash", header(block_hash=block_hash[:31])),
        ("block_hash", header(block_hash=block_hash + b"x")),
        ("block_hash", header(tail_key="r/tail")),                  # both a hash and a tail key
        ("dtype", header(dtype="int8")),
        ("shape", lambda b: b.header.shape.pop()),                  # 4 dimensions
        ("shape", shape(1, 3)),                                      # K, V and a third
        ("shape", shape(3, 0)),
        ("layer_end", header(layer_start=1)),
        ("num_tokens", header(num_tokens=0)),
        ("num_tokens", header(num_tokens=layout.block_size - 1)),   # a full block holds block_size
        ("model_id", header(model_id="")),
        ("model_fingerprint", header(model_fingerprint=b"\x00" * 5)),
        ("model_fingerprint", header(model_fingerprint=other.fingerprint)),  # another dtype's
        ("model_fingerprint", shape(4, layout.block_shape[4] + 1)),          # not this model's shape
        ("checksum", lambda b: b.header.ClearField("checksum")),
        ("data", lambda b: setattr(b, "data", b.data[:-1])),
    ]


def test_every_malformed_block_is_refused_naming_its_field_and_none_is_stored(cluster):
    worker, store = cluster.decodes[0], cluster.kvstore_client()
    hashes = worker.loop.info.prompt_block_hashes(PROMPTS["forged"])
    num_blocks = store.stats().num_blocks
    raw = channel(cluster.kvstore.address)
    put_blocks = raw.stream_unary("/pdserve.v1.KVStore/PutBlocks")  # raw bytes: no client-side checks
    for field, change in _malformed(worker, hashes[1]):
        good, bad = _real_block(worker, hashes[0]), _real_block(worker, hashes[1])
        change(bad)
        with pytest.raises(grpc.RpcError) as err:  # Put: one block per message
            store.put([good, bad])
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith(f"put[1].block.header.{field}" if field != "data"
                                              else "put[1].block.data"), (field, err.value.details())
        with pytest.raises(grpc.RpcError) as err:  # PutBlocks: the workers' path
            message = pb.PutBlocksRequest(headers=[good.header, bad.header])
            put_blocks(iter([batch_codec.encode(message, [good.data, bad.data])]), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith(f"put[0].headers[1].{field}" if field != "data"
                                              else "put[0].data"), (field, err.value.details())
    raw.close()
    assert store.stats().num_blocks == num_blocks
    assert store.lookup(hashes) == 0


def test_a_forged_block_of_the_wrong_shape_under_a_real_prompt_is_refused(cluster, offline):
    worker, store = cluster.decodes[0], cluster.kvstore_client()
    hashes = worker.loop.info.prompt_block_hashes(PROMPTS["forged"])
    layout = worker.loop.info.kv_layout
    wrong = (*layout.block_shape[:3], layout.block_shape[3], layout.block_shape[4] * 2)
    # sealed and self-consistent, except that the model's blocks are not this shape
    forged = block_to_proto(torch.zeros(wrong), layout.block_size, block_hash=hashes[0], model_id=layout.model_id)
    forged.header.model_fingerprint = layout.fingerprint
    with pytest.raises(grpc.RpcError) as err:
        store.put([forged])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("put[0].block.header.model_fingerprint")
    assert store.lookup(hashes) == 0
    assert _generate(cluster, PROMPTS["forged"]) == offline["forged"]


def test_a_block_altered_after_its_checksum_is_refused_counted_and_recomputed(cluster, offline):
    prefill, decode, store = cluster.prefills[0], cluster.decodes[0], cluster.kvstore_client()
    prompt = PROMPTS["checksum"]
    hashes = decode.loop.info.prompt_block_hashes(prompt)
    block = _real_block(decode, hashes[0])
    block.data = b"\x7f" + block.data[1:]  # valid shape and fingerprint; the bytes changed after sealing
    assert store.put([block]) == 1 and store.lookup(hashes) == 1
    before = _rejected(decode, "checksum"), _rejected(prefill, "checksum")
    recomputed = decode.servicer.metrics.recompute._value.get()
    assert _generate(cluster, prompt) == offline["checksum"]
    # both readers refused it: the prefill computed the prompt whole, the decode recomputed it
    assert _rejected(decode, "checksum") == before[0] + 1
    assert _rejected(prefill, "checksum") == before[1] + 1
    assert decode.servicer.metrics.recompute._value.get() == recomputed + 5  # 4 full blocks and the tail


def test_salted_requests_share_no_kv_with_other_salts_and_decode_the_same(cluster, offline):
    prefill, decode, store = cluster.prefills[0], cluster.decodes[0], cluster.kvstore_client()
    prompt, info = PROMPTS["salt"], prefill.loop.info
    assert _generate(cluster, prompt, cache_salt="tenant-b") == offline["salt"]
    assert store.lookup(info.prompt_block_hashes(prompt, "tenant-b")) == 4
    # tenant A cannot find B's prefix in the store, nor can an unsalted probe
    assert store.lookup(info.prompt_block_hashes(prompt, "tenant-a")) == 0
    assert store.lookup(info.prompt_block_hashes(prompt)) == 0
    hits = _hit_tokens(prefill), _hit_tokens(decode)
    assert _generate(cluster, prompt, cache_salt="tenant-a") == offline["salt"]
    assert (_hit_tokens(prefill), _hit_tokens(decode)) == hits  # no local prefix-cache hit either
    assert _generate(cluster, prompt, cache_salt="tenant-b") == offline["salt"]
    assert _hit_tokens(prefill) > hits[0]  # the same salt does share (the counter can move)


def test_a_handle_naming_another_kvstore_is_not_followed(cluster, offline):
    prefill, decode = cluster.prefills[0], cluster.decodes[0]
    prompt = PROMPTS["address"]
    reply = _prefill_direct(prefill, prompt, "address")
    handle = common_pb2.KVHandle()
    handle.CopyFrom(reply.kv_handle)
    handle.kvstore_address = "127.0.0.1:1"  # a forged handle pointing the decode elsewhere
    before, imported = _rejected(decode, "kvstore_address"), decode.servicer.metrics.kvstore_imported._value.get()
    msgs = _decode_direct(decode, prompt, reply.choices[0].token_id, handle, "address")
    assert [reply.choices[0].token_id] + _tokens(msgs) == offline["address"]
    assert _rejected(decode, "kvstore_address") == before + 5
    assert decode.servicer.metrics.kvstore_imported._value.get() == imported
    cluster.kvstore_client().release_lease(reply.kv_handle.lease_id)  # nobody read it


def test_the_offline_api_takes_a_salt_per_prompt(llm, offline):
    prompt = PROMPTS["salt"]
    kv = llm.engine.kv_manager
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    (first,) = llm.generate({"prompt_token_ids": prompt, "cache_salt": "x"}, greedy)
    hits = kv.num_hit_tokens
    (other,) = llm.generate({"prompt_token_ids": prompt, "cache_salt": "y"}, greedy)
    assert kv.num_hit_tokens == hits
    assert first.token_ids == other.token_ids == offline["salt"]
    with pytest.raises(Exception, match="cache_salt"):
        llm.generate({"prompt_token_ids": prompt, "cache_salt": "s" * 257})


def test_a_salt_too_long_is_refused_by_the_router_naming_the_field(cluster):
    client = RouterClient(cluster.router.address)
    try:
        with pytest.raises(grpc.RpcError) as err:
            list(client.generate(PROMPTS["salt"], SamplingParams(max_tokens=2), cache_salt="s" * 257))
    finally:
        client.close()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "cache_salt" in err.value.details()
