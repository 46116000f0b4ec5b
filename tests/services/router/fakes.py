"""Fake workers for the router's tests: the real proto contracts, no model.

A prompt of L tokens generates 1000+L, 1001+L, ... whichever path it takes (the prefill
returns the first of them, a continuing decode the rest, a direct decode all of them),
and token t's text is "<t>"; so every test knows the exact stream it must get.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import grpc

from pdserve.services.common.grpc_server import RunningServer, ServiceSpec, start_server
from pdserve.services.pb import (common_pb2, decode_pb2_grpc, kvstore_pb2, kvstore_pb2_grpc,
                                 prefill_pb2, prefill_pb2_grpc)
from pdserve.services.router.config import PathConfig, RouterConfig
from pdserve.services.router.server import RunningRouter, serve

DEFAULT_MAX_TOKENS = 16  # the workers' default when sampling.max_tokens is unset
DECODE_CACHED = 7        # what a fake decode reports as cached: the router must not pass it on
PREFILL_TIMINGS = dict(prefill_queue_s=0.25, prefill_s=0.5, kv_write_s=0.125)
DECODE_TIMINGS = dict(kv_read_s=0.0625, decode_join_s=0.03125)
WORKER_RETRY_AFTER_MS = "1234"


def expected_tokens(prompt_len: int, max_tokens: int = DEFAULT_MAX_TOKENS) -> list[int]:
    return [1000 + prompt_len + i for i in range(max_tokens)]


def piece(token_id: int) -> str:
    return f"<{token_id}>"


def idle_load() -> common_pb2.WorkerLoad:
    return common_pb2.WorkerLoad(num_free_kv_blocks=100, num_total_kv_blocks=100, max_num_seqs=8)


class _Controls:
    """What a test may change on a fake worker while it runs."""

    def __init__(self) -> None:
        self.load = idle_load()
        self.load_fails = False
        self.load_hold: threading.Event | None = None  # when set: GetLoad waits for it (the poll times out)
        self.fail_with: grpc.StatusCode | None = None
        self.hold: threading.Event | None = None   # when set: calls wait for it (or their cancellation)
        self.holding = threading.Event()           # a call is waiting on `hold`
        self.saw_cancel = threading.Event()        # a call ended because its caller cancelled it
        self.requests: list = []

    def GetLoad(self, request, context):
        if self.load_fails:
            context.abort(grpc.StatusCode.UNAVAILABLE, "injected GetLoad failure")
        if self.load_hold is not None:
            while not self.load_hold.wait(0.01) and context.is_active():
                pass
        return self.load

    def _maybe_fail(self, context) -> None:
        if self.fail_with == grpc.StatusCode.RESOURCE_EXHAUSTED:  # as the real workers' admission
            context.set_trailing_metadata((("retry-after-ms", WORKER_RETRY_AFTER_MS),))
        if self.fail_with is not None:
            context.abort(self.fail_with, "injected failure")

    def _wait_for_hold(self, context) -> bool:
        """False when the caller cancelled while the call was held."""
        if self.hold is None:
            return True
        self.holding.set()
        while not self.hold.wait(0.01):
            if not context.is_active():
                self.saw_cancel.set()
                return False
        return True


class FakePrefill(_Controls, prefill_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, kvstore_address: str):
        super().__init__()
        self.kvstore_address = kvstore_address
        self.finish_reason = ""
        self.handoff: bool | None = None  # set: the choice's handoff whatever its finish_reason (a broken worker)
        self.num_cached_tokens = 0

    def Prefill(self, request: prefill_pb2.PrefillRequest, context) -> prefill_pb2.PrefillResponse:
        self.requests.append(request)
        self._maybe_fail(context)
        if not self._wait_for_hold(context):
            context.abort(grpc.StatusCode.CANCELLED, "cancelled")
        prompt = list(request.prompt_token_ids)
        first = 1000 + len(prompt)
        # as the real worker: a request of one token ends with it, no decode follows
        finish = "length" if request.sampling.HasField("max_tokens") and request.sampling.max_tokens == 1 else ""
        handle = common_pb2.KVHandle(block_hashes=[b"block-%d" % i for i in range(len(prompt) // 16)],
                                     tail_key=f"{request.req_id}/tail", num_tokens=len(prompt),
                                     lease_id=f"lease-{request.req_id}", kvstore_address=self.kvstore_address)
        finish = self.finish_reason or finish
        handoff = not finish if self.handoff is None else self.handoff
        choice = prefill_pb2.FirstToken(token_id=first, text=piece(first), finish_reason=finish, handoff=handoff)
        return prefill_pb2.PrefillResponse(
            req_id=request.req_id, choices=[choice], kv_handle=handle, num_cached_tokens=self.num_cached_tokens,
            timings=common_pb2.Timings(**PREFILL_TIMINGS))


class FakeDecode(_Controls, decode_pb2_grpc.DecodeWorkerServicer):
    def __init__(self) -> None:
        super().__init__()
        self.hold_after = 0  # with `hold`: how many messages to stream before holding
        self.fail_after: int | None = None  # fail (with fail_code) after streaming this many messages
        self.fail_code = grpc.StatusCode.UNAVAILABLE
        self.end_after: int | None = None   # end the stream, unfinished, after this many messages

    def Decode(self, request, context):
        self.requests.append(request)
        self._maybe_fail(context)
        prompt = list(request.prompt_token_ids)
        max_tokens = request.sampling.max_tokens if request.sampling.HasField("max_tokens") else DEFAULT_MAX_TOKENS
        tokens = expected_tokens(len(prompt), max_tokens)
        if request.HasField("first_token_id"):
            assert request.first_token_id == tokens[0] and request.kv_handle.lease_id
            tokens = tokens[1:]
        if request.output_token_ids:  # a resumed request: continues after what was sent
            given = list(request.output_token_ids)
            assert given == tokens[:len(given)] and not request.kv_handle.lease_id
            tokens = tokens[len(given):]
        for i, token in enumerate(tokens):
            if i == self.hold_after and not self._wait_for_hold(context):
                return
            if i == self.fail_after:
                context.abort(self.fail_code, "injected mid-stream failure")
            if i == self.end_after:
                return
            msg = common_pb2.GenerateResponse(req_id=request.req_id, token_ids=[token], text=piece(token))
            if i == len(tokens) - 1:
                msg.finish_reason = "length"
                msg.usage.CopyFrom(common_pb2.Usage(prompt_tokens=len(prompt), completion_tokens=max_tokens,
                                                    cached_prompt_tokens=DECODE_CACHED))
                msg.timings.CopyFrom(common_pb2.Timings(**DECODE_TIMINGS))
            yield msg


class FakeKVStore(kvstore_pb2_grpc.KVStoreServicer):
    def __init__(self) -> None:
        self.releases: list[tuple[str, bool]] = []

    def ReleaseLease(self, request, context):
        self.releases.append((request.lease_id, request.drop_tail))
        return kvstore_pb2.ReleaseLeaseResponse(released=True)


@dataclass
class FakeCluster:
    kvstore: FakeKVStore
    prefills: list[FakePrefill]
    decodes: list[FakeDecode]
    servers: dict[object, RunningServer]
    router: RunningRouter | None = None
    stopped: list = field(default_factory=list)

    def stop_worker(self, fake) -> None:
        self.servers[fake].stop(grace=0)
        self.stopped.append(fake)

    def stop(self) -> None:
        if self.router is not None:
            self.router.stop(grace_s=0)
        running = {id(server): server for fake, server in self.servers.items() if fake not in self.stopped}
        for server in running.values():  # a worker of both roles: one server for two fakes
            server.stop(grace=0)


def _serve(name: str, register, servicer) -> RunningServer:
    return start_server([ServiceSpec(name, register, servicer)], "127.0.0.1", 0, max_workers=16)


def _serve_both(prefill: FakePrefill, decode: FakeDecode) -> RunningServer:
    """A worker of both roles: both services on one port (its address in both pools)."""
    return start_server([ServiceSpec("pdserve.v1.PrefillWorker", prefill_pb2_grpc.add_PrefillWorkerServicer_to_server,
                                     prefill),
                         ServiceSpec("pdserve.v1.DecodeWorker", decode_pb2_grpc.add_DecodeWorkerServicer_to_server,
                                     decode)], "127.0.0.1", 0, max_workers=16)


def start_fake_cluster(model: str, tokenizer, num_prefill: int = 2, num_decode: int = 2, num_both: int = 0,
                       **router_overrides) -> FakeCluster:
    """`num_both` workers of both roles follow the others in each pool: cluster.prefills[-k]
    and cluster.decodes[-k] are two faces of the same one."""
    kvstore = FakeKVStore()
    servers = {kvstore: _serve("pdserve.v1.KVStore", kvstore_pb2_grpc.add_KVStoreServicer_to_server, kvstore)}
    kv_address = f"127.0.0.1:{servers[kvstore].port}"
    cluster = FakeCluster(kvstore, [FakePrefill(kv_address) for _ in range(num_prefill)],
                          [FakeDecode() for _ in range(num_decode)], servers)
    try:
        for p in cluster.prefills:
            servers[p] = _serve("pdserve.v1.PrefillWorker", prefill_pb2_grpc.add_PrefillWorkerServicer_to_server, p)
        for d in cluster.decodes:
            servers[d] = _serve("pdserve.v1.DecodeWorker", decode_pb2_grpc.add_DecodeWorkerServicer_to_server, d)
        for _ in range(num_both):
            p, d = FakePrefill(kv_address), FakeDecode()
            cluster.prefills.append(p)
            cluster.decodes.append(d)
            servers[p] = servers[d] = _serve_both(p, d)
        # polls only when a test asks (router.poll_now()), so every load change is deterministic
        settings = dict(model=model, kvstore_address=kv_address, paths=PathConfig(policy="threshold"),
                        short_prompt_tokens=32, port=0, metrics_port=0,
                        poll_interval_s=3600.0)
        settings.update(router_overrides)
        cluster.router = serve(RouterConfig(
            prefill_addresses=tuple(f"127.0.0.1:{servers[p].port}" for p in cluster.prefills),
            decode_addresses=tuple(f"127.0.0.1:{servers[d].port}" for d in cluster.decodes), **settings),
            tokenizer=tokenizer)
    except Exception:
        cluster.stop()
        raise
    return cluster


def address_of(cluster: FakeCluster, fake) -> str:
    return f"127.0.0.1:{cluster.servers[fake].port}"


def wait_until(condition, what: str, timeout_s: float = 10.0) -> None:
    """Wait for something another thread does; fails (never skips) when it does not happen."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for: {what}")
        time.sleep(0.005)
