"""The prefill worker: the engine in prefill mode behind PrefillWorker.Prefill.

    1. lookup: the longest run of the prompt's block hashes already in the kvstore
    2. import those blocks (minus what the local prefix cache has), compute the rest
    3. write the new full blocks and the tail block to the kvstore under a lease
    4. answer with the first token and the KVHandle; local blocks are already free
"""
from __future__ import annotations

import dataclasses
import logging
import uuid

import grpc
import torch

from engine import InvalidRequestError, RequestOutput
from engine.kv_transfer import KVPayload
from services.common.convert import logprob_to_proto, sampling_from_proto
from services.common.engine_loop import EngineLoop
from services.common.kv_wire import block_from_proto, payload_to_protos
from services.common.worker import (RunningWorker, WorkerConfig, WorkerMetrics, serve_worker,
                                    check_admission, now, worker_load)
from services.kvstore.client import KVStoreClient, KVStoreFullError
from services.pb import common_pb2, prefill_pb2, prefill_pb2_grpc

logger = logging.getLogger(__name__)


class PrefillServicer(prefill_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, cfg: WorkerConfig, loop: EngineLoop, kvstore: KVStoreClient, metrics: WorkerMetrics):
        self.cfg, self.loop, self.kvstore, self.metrics = cfg, loop, kvstore, metrics
        self.engine = loop.engine
        self.block_size = self.engine.config.cache.block_size
        self.draining = False

    def GetLoad(self, request, context):
        return worker_load(self.loop, self.cfg, self.draining)

    def Prefill(self, request: prefill_pb2.PrefillRequest, context) -> prefill_pb2.PrefillResponse:
        check_admission(self.loop, self.cfg, context, self.draining)
        start = now()
        req_id = request.request_id or uuid.uuid4().hex
        prompt = list(request.prompt_token_ids)
        try:
            params = sampling_from_proto(request.sampling)
            self.engine.validate(prompt, params)
        except InvalidRequestError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        hashes = self.engine.prompt_block_hashes(prompt)[: (len(prompt) - 1) // self.block_size]
        imported, num_in_store = self._import_prefix(hashes)
        # A decode follows unless the first token is all the request may have.
        handoff = params.max_tokens > 1 and len(prompt) + 1 < self.engine.max_model_len
        final = self._run(req_id, prompt, params, imported, handoff, request.priority, context)
        response = self._response(req_id, final, handoff)
        if not response.finish_reason:
            t = now()
            response.kv_handle.CopyFrom(self._write_kv(req_id, final.kv_export, num_in_store))
            response.timings.kv_write_s = now() - t
            if not context.is_active():  # the router went away: nobody will release this lease
                self._release_quietly(response.kv_handle.lease_id)
        self._observe(final, start, response)
        return response

    def _import_prefix(self, hashes: list[bytes]) -> tuple[KVPayload | None, int]:
        """Blocks the kvstore has beyond what the local prefix cache has; and how many
        leading blocks the store holds (those need not be written again)."""
        if not hashes:
            return None, 0
        try:
            num_in_store = self.kvstore.lookup(hashes)
        except grpc.RpcError as e:  # a store that is down slows prefills, it does not fail them
            logger.warning("kvstore lookup failed (%s); computing the whole prompt", e.code())
            return None, 0
        num_local = self.loop.call(lambda engine: engine.num_local_prefix_blocks(hashes)).result()
        if num_in_store <= num_local:
            return None, num_in_store
        t = now()
        try:
            blocks = self.kvstore.get(hashes[:num_in_store])
        except grpc.RpcError as e:
            logger.warning("kvstore get failed (%s); computing the whole prompt", e.code())
            return None, 0
        found = 0
        while found < len(blocks) and blocks[found].found:
            found += 1
        self.metrics.kv_transfer.labels("read").observe(now() - t)
        if found == 0:
            return None, 0
        tensors = [block_from_proto(b) for b in blocks[:found]]
        self.metrics.kvstore_imported.inc(found * self.block_size)
        return KVPayload(found * self.block_size, torch.stack(tensors), hashes[:found]), found

    def _run(self, req_id, prompt, params, imported, handoff, priority, context) -> RequestOutput:
        if handoff:
            params = dataclasses.replace(params, max_tokens=1)
        stream = self.loop.submit(req_id, prompt, params, kv_import=imported, export_kv=handoff,
                                  priority=priority)
        if not context.add_callback(lambda: self.loop.abort(req_id)):  # no-op once the request is done
            self.loop.abort(req_id)  # the caller already left
        final = None
        while (out := stream.get()) is not None:
            final = out
        if final is None or final.finish_reason == "abort":
            self.metrics.requests.labels("aborted").inc()
            context.abort(grpc.StatusCode.CANCELLED, f"request {req_id} was aborted")
        return final

    def _response(self, req_id, final: RequestOutput, handoff: bool) -> prefill_pb2.PrefillResponse:
        # in a handoff max_tokens was forced to 1: "length" then means "decode continues"
        finish = "" if handoff and final.finish_reason == "length" else final.finish_reason
        response = prefill_pb2.PrefillResponse(
            request_id=req_id, first_token_id=final.token_ids[0], text=final.text, finish_reason=finish,
            num_cached_tokens=final.num_cached_tokens)
        if final.logprobs:
            response.logprob.CopyFrom(logprob_to_proto(final.logprobs[0]))
        return response

    def _write_kv(self, req_id: str, payload: KVPayload, num_in_store: int) -> common_pb2.KVHandle:
        """Blocks the store already held are not sent again. When the write fails (store
        full or down) the handle still names the blocks: the decode recomputes what it
        cannot read, so the request is slowed, not lost."""
        t = now()
        tail_key = f"{req_id}/tail" if payload.num_tokens % self.block_size else ""
        handle = common_pb2.KVHandle(block_hashes=payload.block_hashes, tail_key=tail_key,
                                     num_tokens=payload.num_tokens, kvstore_address=self.cfg.kvstore_address)
        try:
            handle.lease_id = self.kvstore.create_lease(self.cfg.lease_ttl_ms, req_id)
            self.kvstore.put(payload_to_protos(payload, self.block_size, tail_key, skip_blocks=num_in_store),
                             lease_id=handle.lease_id)
        except (grpc.RpcError, KVStoreFullError) as e:
            logger.warning("kvstore write for %s failed (%s); its decode will recompute", req_id, e)
            self.metrics.kv_write_failures.inc()
            self._release_quietly(handle.lease_id)
            handle.lease_id = ""
        self.metrics.kv_transfer.labels("write").observe(now() - t)
        return handle

    def _release_quietly(self, lease_id: str) -> None:
        if not lease_id:
            return
        try:
            self.kvstore.release_lease(lease_id, drop_tail=True)
        except grpc.RpcError as e:
            logger.warning("releasing lease %s failed (%s); it expires by itself", lease_id, e.code())

    def close(self) -> None:
        self.kvstore.close()

    def _observe(self, final: RequestOutput, start: float, response: prefill_pb2.PrefillResponse) -> None:
        m = self.metrics
        queue_s = (final.first_scheduled_time or final.arrival_time) - final.arrival_time
        response.timings.prefill_queue_s = queue_s
        response.timings.prefill_s = final.first_token_time - (final.first_scheduled_time or final.arrival_time)
        m.queue.observe(queue_s)
        m.ttft.observe(final.first_token_time - final.arrival_time)
        m.e2e.observe(now() - start)
        m.prompt_tokens.inc(len(final.prompt_token_ids))
        m.requests.labels("ok").inc()


def serve(cfg: WorkerConfig, loaded=None) -> RunningWorker:
    def make(loop: EngineLoop, metrics: WorkerMetrics) -> PrefillServicer:
        kvstore = KVStoreClient(cfg.kvstore_address, transport=cfg.kvstore_transport)
        return PrefillServicer(cfg, loop, kvstore, metrics)
    return serve_worker(cfg, loaded, "prefill", "pdserve.v1.PrefillWorker",
                        prefill_pb2_grpc.add_PrefillWorkerServicer_to_server, make)
