"""The raw TCP transport (transports/tcp/frames.py, transports/tcp/server.py, transports/tcp/client.py) on real sockets:
many blocks bit-exact, the connection pool, the hello and its token, TLS, frames that lie
about their lengths, and clients that die mid-transfer (real processes, killed)."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
import pytest
import torch

from pdserve.engine.kv_transfer import KVLayout, KVPayload, as_tensor
from pdserve.services.common.security import ClientSecurity, ServerSecurity
from pdserve.services.common.tls import ClientTLS, ServerTLS
from pdserve.services.kvstore.transports.tcp import frames
from pdserve.services.kvstore.client import KVStoreClient
from pdserve.services.kvstore.errors import KVStoreError
from pdserve.services.kvstore.transports.tcp.server import TcpKVStoreServer
from pdserve.services.pb import kvstore_pb2 as pb
from pdserve.services.worker.kv_wire import payload_from_batches, payload_to_put
from tests.services.kvstore.conftest import h, wire_block

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
BLOCK_SIZE = 16
LAYOUT = KVLayout.of("test-model", "float32", (4, 2, BLOCK_SIZE, 2, 16))  # 16 KiB a block


def payload(num_blocks: int, num_tokens: int, seed: int = 0) -> KVPayload:
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randn((num_blocks, *LAYOUT.block_shape), generator=gen)
    return KVPayload(num_tokens, blocks, [bytes([seed, i % 256, i // 256]) * 10 + b"hh"
                                          for i in range(num_tokens // BLOCK_SIZE)])


def tcp_client(running, **kwargs) -> KVStoreClient:
    return KVStoreClient(running.address, transport="tcp", timeout_s=10, **kwargs)


# ---- raw frames, as any peer may send them -------------------------------------------

def connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def hello(sock: socket.socket, token: bytes = b"") -> frames.Header:
    frames.send_all(sock, [frames.header(frames.HELLO, len(token)), token])
    return read_frame(sock)[0]


def read_frame(sock: socket.socket) -> tuple[frames.Header, bytes, bytes]:
    head = frames.recv_bytes(sock, frames.HEADER.size)
    header = frames.unpack(bytes(head))
    return header, bytes(frames.recv_bytes(sock, header.message_len)), bytes(frames.recv_bytes(sock, header.data_len))


def read_error(sock: socket.socket) -> KVStoreError:
    header, body, _ = read_frame(sock)
    assert header.kind == frames.ERROR
    return frames.parse_error(body)


def is_closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def put_frame(message: pb.PutBlocksRequest, data_len: int) -> list:
    body = message.SerializeToString()
    return [frames.header(frames.PUT_BLOCKS, len(body), data_len), body]


# ---- blocks ---------------------------------------------------------------------------

def test_many_blocks_with_a_tail_and_a_gap_round_trip_bit_exact(start_kvstore):
    running = start_kvstore(capacity_bytes=64 << 20)
    client = tcp_client(running)
    sent = payload(num_blocks=301, num_tokens=300 * BLOCK_SIZE + 7, seed=1)  # 300 full blocks, a tail
    headers, data = payload_to_put(sent, LAYOUT, tail_key="r/tail")
    assert client.put_blocks(headers, data) == 301
    [answer] = client.get_blocks(sent.block_hashes, ["r/tail"])
    assert list(answer.message.found) == [True] * 301
    got = payload_from_batches([answer], sent.block_hashes, LAYOUT, "r/tail", 7).payload
    assert got.num_tokens == sent.num_tokens and torch.equal(as_tensor(got.blocks), sent.blocks)
    missing = [h(b"absent")]
    [answer] = client.get_blocks(sent.block_hashes[:2] + missing + sent.block_hashes[3:5], ["r/tail", "no/tail"])
    assert list(answer.message.found) == [True, True, False, True, True, True, False]
    assert answer.message.headers[2].block_hash == missing[0] and answer.message.headers[6].tail_key == "no/tail"
    assert len(answer.data) == 5 * LAYOUT.block_nbytes  # the found ones only
    assert bytes(answer.data[2 * LAYOUT.block_nbytes:3 * LAYOUT.block_nbytes]) == \
        bytes(data[3 * LAYOUT.block_nbytes:4 * LAYOUT.block_nbytes])
    client.close()


def test_stored_blocks_keep_their_own_buffers(start_kvstore):
    """Each block read into a buffer of its own: the memory store keeps it as it is."""
    running = start_kvstore(capacity_bytes=8 << 20)
    client = tcp_client(running)
    client.put_blocks(*payload_to_put(payload(4, 4 * BLOCK_SIZE), LAYOUT, tail_key=""))
    stored = [entry.block.data for entry in running.store._entries.values()]
    assert len(stored) == 4 and all(memoryview(d.obj).nbytes == d.nbytes == LAYOUT.block_nbytes for d in stored)
    client.close()


def test_an_answer_in_use_is_never_received_into_again(start_kvstore):
    """Answers' buffers are reused (ReusedBuffers), but only once nothing views them."""
    running = start_kvstore(capacity_bytes=8 << 20)
    client = tcp_client(running)
    sent = [payload(3, 3 * BLOCK_SIZE, seed=s) for s in (10, 11)]
    for p in sent:
        client.put_blocks(*payload_to_put(p, LAYOUT, tail_key=""))

    def read(p: KVPayload) -> torch.Tensor:
        return payload_from_batches(client.get_blocks(p.block_hashes), p.block_hashes, LAYOUT).payload.blocks
    kept = read(sent[0])  # a payload tensor still in use, as an import in progress
    for _ in range(6):
        assert torch.equal(read(sent[1]), sent[1].blocks)
    assert torch.equal(kept, sent[0].blocks)
    client.close()


def test_receive_buffers_are_reused_once_free_and_bounded():
    from pdserve.services.kvstore.transports.reused_buffers import ReusedBuffers
    buffers = ReusedBuffers(max_buffers=2)
    first = buffers.take(100)
    owner = id(first.obj)  # not the object: a reference to it would keep it in use
    del first
    again = buffers.take(80)  # free and large enough: the same memory
    assert id(again.obj) == owner and len(again) == 80
    held = [again, buffers.take(100), buffers.take(100)]  # the third is not kept: the pool is full
    assert len({id(v.obj) for v in held}) == 3 and len(buffers._buffers) == 2
    del held
    big = buffers.take(1000)  # every kept one free but too small: a new one, kept in place of the smallest
    assert len(buffers._buffers) == 2 and any(b is big.obj for b in buffers._buffers)


def test_a_waiting_get_holds_up_no_other_call_of_the_client(start_kvstore):
    running = start_kvstore(capacity_bytes=8 << 20)
    client = tcp_client(running)
    sent = payload(2, 2 * BLOCK_SIZE, seed=2)
    lease = client.create_lease(10_000, write_pending=True)
    waiting = threading.Thread(target=lambda: client.get_blocks(sent.block_hashes, lease_id=lease, wait_ms=10_000))
    waiting.start()
    time.sleep(0.2)
    start = time.monotonic()
    client.put_blocks(*payload_to_put(sent, LAYOUT, tail_key=""), lease_id=lease)  # another pooled connection
    assert time.monotonic() - start < 2 and waiting.is_alive()
    client.end_write(lease)
    waiting.join(timeout=5)
    assert not waiting.is_alive()
    client.close()


def test_a_pooled_connection_to_a_restarted_listener_is_tried_again_afresh(start_kvstore):
    running = start_kvstore()
    client = tcp_client(running)
    assert list(client.get_blocks([h(b"a")])[0].message.found) == [False]  # a connection now pooled
    port = running._tcp.port
    running._tcp.stop()
    running._tcp = TcpKVStoreServer(running._tcp.handlers, "127.0.0.1", port)
    assert list(client.get_blocks([h(b"a")])[0].message.found) == [False]
    client.close()


def test_a_listener_restarted_on_another_port_is_found_again(start_kvstore):
    from pdserve.services.kvstore.transports.tcp.frames import TCP_PORT_METADATA
    running = start_kvstore()
    client = tcp_client(running)
    assert list(client.get_blocks([h(b"a")])[0].message.found) == [False]
    running._tcp.stop()
    running._tcp = TcpKVStoreServer(running._tcp.handlers, "127.0.0.1", 0)  # as a kvstore restarted on port 0
    running.servicer._stats_metadata = ((TCP_PORT_METADATA, str(running._tcp.port)),)
    assert list(client.get_blocks([h(b"a")])[0].message.found) == [False]
    client.close()


# ---- refusals that keep the connection -------------------------------------------------

def test_a_refused_request_names_its_field_and_the_connection_serves_on(start_kvstore):
    running = start_kvstore()
    header = wire_block(b"h", num_layers=1).header  # 32 bytes of data
    with connect(running.tcp_address) as sock:
        assert hello(sock).kind == frames.HELLO_OK
        frames.send_all(sock, [*put_frame(pb.PutBlocksRequest(headers=[header]), 31), b"\0" * 31,
                               frames.header(frames.PUT_END)])
        error = read_error(sock)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.details().startswith("put[0].data: has 31 bytes, its headers say 32")
        frames.send_all(sock, [*put_frame(pb.PutBlocksRequest(lease_id="nope", headers=[header]), 32), b"\0" * 32,
                               frames.header(frames.PUT_END)])
        assert read_error(sock).code() == grpc.StatusCode.FAILED_PRECONDITION
        frames.send_all(sock, frames.frame(frames.GET_BLOCKS, pb.GetRequest(block_hashes=[b"short"])))
        assert read_error(sock).details().startswith("block_hashes[0]: is 5 bytes")
        frames.send_all(sock, [*put_frame(pb.PutBlocksRequest(headers=[header]), 32), b"\0" * 32,
                               frames.header(frames.PUT_END)])
        reply, body, _ = read_frame(sock)
        assert reply.kind == frames.PUT_REPLY and pb.PutResponse.FromString(body).num_stored == 1


def test_a_put_above_the_capacity_is_full(start_kvstore):
    running = start_kvstore(capacity_bytes=4 * LAYOUT.block_nbytes)
    client = tcp_client(running)
    with pytest.raises(KVStoreError) as e:
        client.put_blocks(*payload_to_put(payload(8, 8 * BLOCK_SIZE), LAYOUT, tail_key=""))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "frame.data_length" in e.value.details()
    assert running.metrics.puts_rejected_total.labels("full")._value.get() == 1
    assert client.put_blocks(*payload_to_put(payload(2, 2 * BLOCK_SIZE), LAYOUT, tail_key="")) == 2
    client.close()


# ---- bad frames: an error naming the field, then the connection closes -------------------

BAD_AFTER_HELLO = {
    "frame.magic": [b"XX" + frames.header(frames.GET_BLOCKS)[2:]],
    "frame.version": [frames.HEADER.pack(frames.MAGIC, 9, frames.GET_BLOCKS, 0, 0)],
    "frame.kind": [frames.header(frames.BATCH)],
    "frame.message_length": [frames.header(frames.GET_BLOCKS, 1 << 31)],
    "frame.data_length": [frames.header(frames.PUT_BLOCKS, 0, 1 << 60)],
    "frame.message": [frames.header(frames.GET_BLOCKS, 3), b"\xff\xff\xff"],
}


@pytest.mark.parametrize("field", list(BAD_AFTER_HELLO))
def test_a_bad_frame_gets_an_error_naming_its_field_then_the_connection_closes(start_kvstore, field):
    running = start_kvstore()
    with connect(running.tcp_address) as sock:
        assert hello(sock).kind == frames.HELLO_OK
        frames.send_all(sock, BAD_AFTER_HELLO[field])
        error = read_error(sock)
        assert error.details().startswith(field + ":"), error
        assert is_closed(sock)
    client = tcp_client(running)  # and the server serves others
    assert list(client.get_blocks([h(b"a")])[0].message.found) == [False]
    client.close()


def test_the_first_frame_must_be_the_hello(start_kvstore):
    running = start_kvstore()
    with connect(running.tcp_address) as sock:
        frames.send_all(sock, frames.frame(frames.GET_BLOCKS, pb.GetRequest(block_hashes=[h(b"a")])))
        assert read_error(sock).details().startswith("frame.kind: GET_BLOCKS where HELLO was expected")
        assert is_closed(sock)
    with connect(running.tcp_address) as sock:  # a token longer than any is refused before it is read
        frames.send_all(sock, [frames.header(frames.HELLO, 1 << 30)])
        assert read_error(sock).details().startswith("frame.message_length:")
        assert is_closed(sock)


# ---- the token and TLS --------------------------------------------------------------------

def test_only_the_internal_token_is_admitted(start_kvstore):
    running = start_kvstore(security=ServerSecurity(tokens=("tok-new", "tok-old")))
    for token in (None, "wrong"):
        client = tcp_client(running, security=ClientSecurity(token), tcp_address=running.tcp_address)
        with pytest.raises(KVStoreError) as e:
            client.get_blocks([h(b"a")])
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "internal token" in e.value.details()
        client.close()
    with connect(running.tcp_address) as sock:  # refused, then closed
        assert hello(sock, b"tok-newer") == frames.Header(frames.ERROR, len(b"UNAUTHENTICATED\ninvalid internal "
                                                                            b"token"), 0)
        assert is_closed(sock)
    for token in ("tok-new", "tok-old"):
        client = tcp_client(running, security=ClientSecurity(token))
        assert list(client.get_blocks([h(b"a")])[0].message.found) == [False]
        client.close()


def test_tls_with_the_grpc_ports_certificates(start_kvstore, tmp_path):
    from tests.services.security.certs import SERVER_NAME, make_certs
    certs = make_certs(tmp_path)
    tls = ServerTLS(certs.cert, certs.key, certs.ca)  # mTLS
    running = start_kvstore(capacity_bytes=8 << 20, security=ServerSecurity(tokens=("tok",), tls=tls))
    client_tls = ClientTLS(certs.ca, certs.cert, certs.key, SERVER_NAME)
    client = tcp_client(running, security=ClientSecurity("tok", client_tls))
    sent = payload(5, 5 * BLOCK_SIZE, seed=4)
    assert client.put_blocks(*payload_to_put(sent, LAYOUT, tail_key="")) == 5
    got = payload_from_batches(client.get_blocks(sent.block_hashes), sent.block_hashes, LAYOUT).payload
    assert torch.equal(as_tensor(got.blocks), sent.blocks)
    client.close()
    no_cert = KVStoreClient(running.address, transport="tcp", tcp_address=running.tcp_address, timeout_s=5,
                            security=ClientSecurity("tok", ClientTLS(certs.ca, server_name=SERVER_NAME)))
    with pytest.raises(KVStoreError) as e:
        no_cert.get_blocks([h(b"a")])
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    no_cert.close()
    with connect(running.tcp_address) as sock:  # plaintext to a TLS port: the handshake fails, closed
        frames.send_all(sock, [frames.header(frames.HELLO, 3), b"tok"])
        assert is_closed(sock)


# ---- peers that lie or die: real processes ------------------------------------------------

def _start_kvstore_process(tmp_path, capacity: str) -> tuple[subprocess.Popen, str, str]:
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.services.kvstore.main", "--port", "0", "--tcp-port", "0",
                             "--capacity-bytes", capacity], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": ROOT}, stderr=subprocess.DEVNULL)
    line = proc.stdout.readline()
    match = re.search(r"kvstore serving on (\S+),.* tcp (\S+?)(?:,|$)", line)
    assert match, line
    return proc, match.group(1), match.group(2)


def _peak_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+) kB", f.read()).group(1)) / 1024


def test_forged_lengths_cost_the_server_no_memory(tmp_path):
    proc, address, tcp_address = _start_kvstore_process(tmp_path, "8GiB")
    try:
        before = _peak_rss_mb(proc.pid)
        liars = []
        one_huge_block = pb.KVBlockHeader(block_hash=h(b"x"), dtype="float32", shape=[1, 2, 16, 1, 1 << 24],
                                          layer_end=1, num_tokens=16)  # 2 GiB, says the header
        for message, data_len in ((pb.PutBlocksRequest(headers=[one_huge_block]), 2 << 30),  # per block
                                  (pb.PutBlocksRequest(headers=[one_huge_block]), 6 << 30),  # disagreeing
                                  (pb.PutBlocksRequest(), 7 << 30)):
            sock = connect(tcp_address)
            assert hello(sock).kind == frames.HELLO_OK
            frames.send_all(sock, [*put_frame(message, data_len), b"\0" * (1 << 20)])  # then nothing more
            liars.append(sock)
        with connect(tcp_address) as sock:  # over the capacity: refused at once
            assert hello(sock).kind == frames.HELLO_OK
            frames.send_all(sock, put_frame(pb.PutBlocksRequest(), 9 << 30))
            assert read_error(sock).details().startswith("frame.data_length: 9663676416 bytes is above the limit")
        client = KVStoreClient(address, transport="tcp", timeout_s=10)  # the server serves others meanwhile
        sent = payload(8, 8 * BLOCK_SIZE, seed=6)
        assert client.put_blocks(*payload_to_put(sent, LAYOUT, tail_key="")) == 8
        assert torch.equal(as_tensor(payload_from_batches(client.get_blocks(sent.block_hashes), sent.block_hashes,
                                                LAYOUT).payload.blocks), sent.blocks)
        client.close()
        assert _peak_rss_mb(proc.pid) - before < 150  # not the 15 GiB claimed
        for sock in liars:
            sock.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


_DYING_CLIENT = """
import socket, sys, time
from pdserve.services.kvstore.transports.tcp import frames
from pdserve.services.pb import kvstore_pb2 as pb
host, port, what, hash_hex = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
sock = socket.create_connection((host, port))
frames.send_all(sock, [frames.header(frames.HELLO)])
sock.recv(16)
if what == "put":
    header = pb.KVBlockHeader(block_hash=bytes.fromhex(hash_hex), dtype="float32", shape=[64, 2, 16, 2, 64],
                              layer_end=64, num_tokens=16)
    body = pb.PutBlocksRequest(headers=[header] * 4).SerializeToString()
    frames.send_all(sock, [frames.header(frames.PUT_BLOCKS, len(body), 4 << 20), body, b"\\0" * (1 << 20)])
else:
    body = pb.GetRequest(block_hashes=[bytes.fromhex(hash_hex)] * 4096).SerializeToString()
    frames.send_all(sock, [frames.header(frames.GET_BLOCKS, len(body)), body])  # the answer never read
print("sent", flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("what", ["put", "get"])
def test_a_client_killed_mid_transfer_leaves_the_server_serving(start_kvstore, what):
    running = start_kvstore(capacity_bytes=256 << 20)
    client = tcp_client(running)
    stored = payload(1, BLOCK_SIZE, seed=7)
    client.put_blocks(*payload_to_put(stored, LAYOUT, tail_key=""))  # 4096 x 16 KiB answers: 64 MiB to send
    host, port = running.tcp_address.rsplit(":", 1)
    dying = subprocess.Popen([sys.executable, "-c", _DYING_CLIENT, host, port, what, stored.block_hashes[0].hex()],
                             cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, stdout=subprocess.PIPE, text=True)
    assert dying.stdout.readline().strip() == "sent"
    time.sleep(0.2)  # the server is now mid-frame with it
    dying.kill()
    dying.wait(timeout=10)
    sent = payload(6, 6 * BLOCK_SIZE, seed=8)
    assert client.put_blocks(*payload_to_put(sent, LAYOUT, tail_key="")) == 6
    got = payload_from_batches(client.get_blocks(sent.block_hashes), sent.block_hashes, LAYOUT).payload
    assert torch.equal(as_tensor(got.blocks), sent.blocks)
    deadline = time.monotonic() + 10
    while len(running._tcp._connections) > 1 and time.monotonic() < deadline:  # the client's own pooled one
        time.sleep(0.05)
    assert len(running._tcp._connections) == 1
    client.close()
