"""Many blocks per message (issue 13): the block codec against protobuf itself, and
put_blocks / get_blocks end to end over each transport, with the wait on a pending write."""
from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch

from pdserve.engine.kv_transfer import KVLayout, KVPayload, as_tensor
from pdserve.services.common.grpc_server import channel
from pdserve.services.kvstore import batch_codec
from pdserve.services.kvstore.client import KVStoreClient
from pdserve.services.kvstore.errors import InvalidArgument
from pdserve.services.pb import kvstore_pb2 as pb
from pdserve.services.pb import kvstore_pb2_grpc
from pdserve.services.worker.kv_wire import payload_from_batches, payload_to_put
from tests.services.kvstore.conftest import h, wire_block

BLOCK_SIZE = 4
LAYOUT = KVLayout.of("test-model", "bfloat16", (3, 2, BLOCK_SIZE, 2, 8))


def test_the_codec_writes_what_protobuf_reads_and_reads_what_it_writes():
    header = pb.KVBlockHeader(block_hash=b"h", dtype="float16", shape=[1, 2, 4, 1, 2], layer_end=1, num_tokens=4)
    message = pb.PutBlocksRequest(lease_id="L", headers=[header, header])
    data = [b"\x01" * 32, memoryview(b"\x02" * 32)]
    encoded = batch_codec.encode(message, data)
    parsed = pb.PutBlocksRequest.FromString(encoded)
    assert parsed.data == b"\x01" * 32 + b"\x02" * 32 and list(parsed.headers) == [header, header]
    # protobuf's own encoding (data not last, fields in its order) decodes the same
    decoded = batch_codec.decode(parsed.SerializeToString(), pb.PutBlocksRequest)
    assert decoded.message == pb.PutBlocksRequest(lease_id="L", headers=[header, header])
    assert bytes(decoded.data) == parsed.data
    assert batch_codec.decode(b"", pb.KVBlockBatch).data.nbytes == 0


@pytest.mark.parametrize("bad", [b"\x7a\xff", b"\x0a\x05ab", b"\x0f"])
def test_a_malformed_message_is_invalid_argument(bad):
    with pytest.raises(InvalidArgument) as e:
        batch_codec.decode(bad, pb.PutBlocksRequest)
    assert e.value.field == "frame"


def payload(num_blocks: int, num_tokens: int, seed: int = 0) -> KVPayload:
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randn((num_blocks, 3, 2, BLOCK_SIZE, 2, 8), generator=gen).to(torch.bfloat16)
    hashes = [bytes([seed, i]) * 16 for i in range(num_tokens // BLOCK_SIZE)]
    return KVPayload(num_tokens, blocks, hashes)


@pytest.fixture(params=["grpc", "tcp", "ucx"])
def client(request, start_kvstore):
    running = start_kvstore(capacity_bytes=64 << 20)
    c = KVStoreClient(running.address, transport=request.param)
    yield c
    c.close()


def test_a_payload_round_trips_bit_exact_with_its_tail(client):
    sent = payload(num_blocks=5, num_tokens=4 * BLOCK_SIZE + 3)   # 4 full blocks and a tail
    headers, data = payload_to_put(sent, LAYOUT, tail_key="r/tail")
    assert client.put_blocks(headers, data) == 5
    got = payload_from_batches(client.get_blocks(sent.block_hashes, ["r/tail"]), sent.block_hashes, LAYOUT,
                               "r/tail", 3).payload
    assert got.num_tokens == sent.num_tokens and got.block_hashes == sent.block_hashes
    assert torch.equal(as_tensor(got.blocks), sent.blocks)


def test_a_missing_block_ends_the_usable_prefix(client):
    sent = payload(num_blocks=4, num_tokens=4 * BLOCK_SIZE)
    headers, data = payload_to_put(sent, LAYOUT, tail_key="")
    client.put_blocks(headers[:2] + headers[3:], bytes(data[:2 * len(data) // 4]) + bytes(data[3 * len(data) // 4:]))
    batches = client.get_blocks(sent.block_hashes)
    assert [f for b in batches for f in b.message.found] == [True, True, False, True]
    got = payload_from_batches(batches, sent.block_hashes, LAYOUT).payload
    assert got.num_tokens == 2 * BLOCK_SIZE and torch.equal(as_tensor(got.blocks), sent.blocks[:2])


def test_an_answer_of_many_batches_joins_in_order(client, monkeypatch):
    from pdserve.services.kvstore import handlers
    monkeypatch.setattr(handlers, "BATCH_BYTES", 1)  # one block per batch
    sent = payload(num_blocks=6, num_tokens=6 * BLOCK_SIZE, seed=3)
    client.put_blocks(*payload_to_put(sent, LAYOUT, tail_key=""))
    batches = client.get_blocks(sent.block_hashes)
    assert len(batches) == (1 if client.transport == "tcp" else 6)  # TCP: one frame, one buffer, whatever the batches
    assert torch.equal(as_tensor(payload_from_batches(batches, sent.block_hashes, LAYOUT).payload.blocks), sent.blocks)


def test_a_read_waits_for_the_pending_write_of_its_lease(client):
    sent = payload(num_blocks=3, num_tokens=2 * BLOCK_SIZE + 1, seed=5)
    lease = client.create_lease(10_000, write_pending=True)

    def write_late():
        time.sleep(0.3)
        client.put_blocks(*payload_to_put(sent, LAYOUT, tail_key="w/tail"), lease_id=lease)
        client.end_write(lease)
    writer = threading.Thread(target=write_late)
    writer.start()
    start = time.monotonic()
    batches = client.get_blocks(sent.block_hashes, ["w/tail"], lease_id=lease, wait_ms=10_000)
    waited = time.monotonic() - start
    writer.join()
    got = payload_from_batches(batches, sent.block_hashes, LAYOUT, "w/tail", 1).payload
    assert got is not None and torch.equal(as_tensor(got.blocks), sent.blocks)
    assert 0.25 < waited < 5
    assert client.release_lease(lease) is True


def test_a_failed_or_stuck_write_is_read_as_it_stands(client):
    sent = payload(num_blocks=2, num_tokens=2 * BLOCK_SIZE)
    failed, stuck = client.create_lease(10_000, write_pending=True), client.create_lease(10_000, write_pending=True)
    assert client.end_write(failed, failed=True) is True
    assert client.end_write(failed) is False
    for lease, wait_ms in ((failed, 10_000), (stuck, 200)):
        start = time.monotonic()
        batches = client.get_blocks(sent.block_hashes, lease_id=lease, wait_ms=wait_ms)
        assert time.monotonic() - start < 5
        assert payload_from_batches(batches, sent.block_hashes, LAYOUT).payload is None


def test_a_put_blocks_with_a_wrong_size_is_refused_naming_the_field(start_kvstore):
    running = start_kvstore()
    header = wire_block(b"h", num_layers=1).header
    with channel(running.address) as ch:
        put = ch.stream_unary("/pdserve.v1.KVStore/PutBlocks")  # raw bytes, as any client may send
        with pytest.raises(grpc.RpcError) as e:
            put(iter([batch_codec.encode(pb.PutBlocksRequest(headers=[header]), [b"\x00" * 31])]), timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details().startswith("put[0].data: has 31 bytes, its headers say 32")
        with pytest.raises(grpc.RpcError) as e:
            put(iter([b"\x0f"]), timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("put[0].frame")
        # and the generated stub (protobuf's own encoding) is served as well
        stub = kvstore_pb2_grpc.KVStoreStub(ch)
        request = pb.PutBlocksRequest(headers=[header], data=b"\x00" * 32)
        assert stub.PutBlocks(iter([request]), timeout=5).num_stored == 1
        answer = list(stub.GetBlocks(pb.GetRequest(block_hashes=[h(b"h"), h(b"x")]), timeout=5))
        assert [list(a.found) for a in answer] == [[True, False]] and answer[0].data == b"\x00" * 32
