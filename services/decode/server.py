"""The decode worker: the engine in decode mode behind DecodeWorker.Decode.

A continuation (first_token_id + kv_handle) pulls its prompt's blocks from the kvstore on
the RPC thread while the engine keeps stepping, then joins the running batch with the KV
imported; a block the store no longer has is recomputed (the engine computes whatever
the import does not cover). A short prompt (no handle) is prefilled here.
"""
from __future__ import annotations

import logging
import threading
import uuid

import grpc
import torch

from engine import InvalidRequestError, RequestOutput
from engine.kv_transfer import KVPayload
from services.common.convert import logprob_to_proto, sampling_from_proto
from services.common.engine_loop import EngineLoop
from services.common.kv_wire import block_from_proto
from services.common.worker import (RunningWorker, WorkerConfig, WorkerMetrics, check_admission, now,
                                    serve_worker, worker_load)
from services.kvstore.client import KVStoreClient
from services.pb import common_pb2, decode_pb2_grpc, router_pb2

logger = logging.getLogger(__name__)


class DecodeServicer(decode_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, cfg: WorkerConfig, loop: EngineLoop, metrics: WorkerMetrics):
        self.cfg, self.loop, self.metrics = cfg, loop, metrics
        self.engine = loop.engine
        self.block_size = self.engine.config.cache.block_size
        self._kvstores: dict[str, KVStoreClient] = {}
        self._kvstores_lock = threading.Lock()
        self.draining = False

    def GetLoad(self, request, context):
        return worker_load(self.loop, self.cfg, self.draining)

    def Decode(self, request, context):
        check_admission(self.loop, self.cfg, context, self.draining)
        start = now()
        req_id = request.request_id or uuid.uuid4().hex
        prompt = list(request.prompt_token_ids)
        continuation = request.HasField("first_token_id")
        first = [request.first_token_id] if continuation else []
        try:
            params = sampling_from_proto(request.sampling)
            self.engine.validate(prompt, params)
        except InvalidRequestError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        kv_import, kv_read_s = self._pull_kv(request) if continuation else (None, 0.0)
        try:
            stream = self.loop.submit(req_id, prompt, params, output_token_ids=first, kv_import=kv_import,
                                      priority=request.priority)
        except InvalidRequestError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if not context.add_callback(lambda: self.loop.abort(req_id)):
            self.loop.abort(req_id)  # the caller left while the KV was being pulled
        yield from self._stream(stream, req_id, len(first), kv_read_s, start, context)

    # ---- KV from the kvstore ---------------------------------------------------------
    def _pull_kv(self, request) -> tuple[KVPayload | None, float]:
        """The longest usable prefix of the handle's blocks: full blocks up to the first
        missing one, plus the tail only when every full block arrived. Then the lease is
        released: the decode holds its own copy now."""
        handle = request.kv_handle
        if not handle.kvstore_address:
            return None, 0.0
        t = now()
        client = self._kvstore(handle.kvstore_address)
        try:
            tails = [handle.tail_key] if handle.tail_key else []
            blocks = client.get(list(handle.block_hashes), tails)
        except grpc.RpcError as e:
            logger.warning("kvstore read for %s failed (%s); recomputing its prompt", request.request_id, e.code())
            self.metrics.recompute.inc(len(handle.block_hashes) + bool(handle.tail_key))
            return None, now() - t
        finally:
            self._release(client, handle.lease_id)
        usable = []
        for block in blocks:
            if not block.found:
                break
            usable.append(block)
        num_full = min(len(usable), len(handle.block_hashes))
        num_tokens = num_full * self.block_size
        if len(usable) == len(blocks):
            num_tokens = handle.num_tokens
        self.metrics.recompute.inc(len(blocks) - len(usable))
        seconds = now() - t
        self.metrics.kv_transfer.labels("read").observe(seconds)
        if not usable:
            return None, seconds
        tensors = torch.stack([block_from_proto(b) for b in usable])
        self.metrics.kvstore_imported.inc(num_tokens)
        return KVPayload(num_tokens, tensors, list(handle.block_hashes[:num_full])), seconds

    def _kvstore(self, address: str) -> KVStoreClient:
        with self._kvstores_lock:
            if address not in self._kvstores:
                self._kvstores[address] = KVStoreClient(address, transport=self.cfg.kvstore_transport)
            return self._kvstores[address]

    def _release(self, client: KVStoreClient, lease_id: str) -> None:
        if not lease_id:
            return
        try:
            client.release_lease(lease_id, drop_tail=True)
        except grpc.RpcError as e:
            logger.warning("releasing lease %s failed (%s); it expires by itself", lease_id, e.code())

    def close(self) -> None:
        with self._kvstores_lock:
            for client in self._kvstores.values():
                client.close()

    # ---- streaming -------------------------------------------------------------------
    def _stream(self, stream, req_id: str, num_given: int, kv_read_s: float, start: float, context):
        last_token_time, final = None, None
        try:
            while (out := stream.get()) is not None:
                t = now()
                if last_token_time is not None:
                    self.metrics.itl.observe(t - last_token_time)
                elif num_given == 0:
                    self.metrics.ttft.observe(t - start)
                last_token_time = t
                self.metrics.generated_tokens.inc(len(out.new_token_ids))
                final = out
                yield self._message(out, req_id, num_given, kv_read_s)
        finally:
            if final is None or not final.finished:  # closed early: the caller went away
                self.loop.abort(req_id)
        if final is None or final.finish_reason == "abort":
            self.metrics.requests.labels("aborted").inc()
            if context.is_active():
                context.abort(grpc.StatusCode.CANCELLED, f"request {req_id} was aborted")
            return
        self.metrics.requests.labels("ok").inc()
        if num_given == 0:  # the direct path: this worker prefilled the prompt itself
            self.metrics.prompt_tokens.inc(len(final.prompt_token_ids))
        self.metrics.e2e.observe(now() - start)
        self.metrics.queue.observe((final.first_scheduled_time or final.arrival_time) - final.arrival_time)

    def _message(self, out: RequestOutput, req_id: str, num_given: int, kv_read_s: float) -> router_pb2.GenerateResponse:
        msg = router_pb2.GenerateResponse(request_id=req_id, token_ids=out.new_token_ids, text=out.new_text)
        if out.logprobs:
            msg.logprobs.extend(logprob_to_proto(lp) for lp in out.logprobs[-len(out.new_token_ids):])
        if out.finished:
            msg.finish_reason = out.finish_reason
            msg.usage.CopyFrom(common_pb2.Usage(prompt_tokens=len(out.prompt_token_ids),
                                                completion_tokens=len(out.token_ids),
                                                cached_prompt_tokens=out.num_cached_tokens))
            msg.timings.kv_read_s = kv_read_s
            msg.timings.decode_join_s = (out.first_scheduled_time or out.arrival_time) - out.arrival_time
        return msg


def serve(cfg: WorkerConfig, loaded=None) -> RunningWorker:
    return serve_worker(cfg, loaded, "decode", "pdserve.v1.DecodeWorker",
                        decode_pb2_grpc.add_DecodeWorkerServicer_to_server,
                        lambda loop, metrics: DecodeServicer(cfg, loop, metrics))
