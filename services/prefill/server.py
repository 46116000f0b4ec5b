"""The prefill worker: prefill-only requests of the engine behind PrefillWorker.Prefill.

    1. lookup: the longest run of the prompt's block hashes already in the kvstore
    2. import those blocks (minus what the local prefix cache has), compute the rest
    3. write the new full blocks and the tail block to the kvstore under a lease
    4. answer with the first token and the KVHandle; local blocks are already free

The engine ends each request after its first token (RequestMode.PREFILL_ONLY): with a
real finish reason when that token ends it, else as a hand-off carrying the prompt's KV.
"""
from __future__ import annotations

import logging

import grpc

from engine import RequestOutput
from engine.kv_transfer import KVPayload
from engine.request import RequestMode, RequestStatus
from services.common.convert import logprob_to_proto
from services.kvstore.client import KVStoreClient, KVStoreFullError
from services.pb import common_pb2, prefill_pb2, prefill_pb2_grpc
from services.worker.config import WorkerConfig
from services.worker.engine_loop import EngineLoop
from services.worker.kv_wire import payload_from_protos, payload_to_protos
from services.worker.metrics import WorkerMetrics
from services.worker.runtime import RunningWorker, serve_worker
from services.worker.servicer import AdmittedRequest, WorkerServicer, now

logger = logging.getLogger(__name__)
_HANDOFF = RequestStatus.FINISHED_HANDOFF.value


class PrefillServicer(WorkerServicer, prefill_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, cfg: WorkerConfig, loop: EngineLoop, kvstore: KVStoreClient, metrics: WorkerMetrics):
        super().__init__(cfg, loop, metrics)
        self.kvstore = kvstore

    def Prefill(self, request: prefill_pb2.PrefillRequest, context) -> prefill_pb2.PrefillResponse:
        req = self.admit(request, context)
        # the last prompt token is always computed here: it samples the first token
        hashes = self.loop.info.prompt_block_hashes(req.prompt_token_ids)[
            : (len(req.prompt_token_ids) - 1) // self.block_size]
        imported, num_in_store = self._import_prefix(hashes)
        final = self._run(req, imported, context)
        response = self._response(req.req_id, final)
        if final.kv_export is not None:
            t = now()
            response.kv_handle.CopyFrom(self._write_kv(req.req_id, final.kv_export, num_in_store))
            response.timings.kv_write_s = now() - t
            if not context.is_active():  # the router went away: nobody will release this lease
                self.kvstore.release_lease_quietly(response.kv_handle.lease_id)
        self._observe(final, req.start, response)
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
        self.metrics.kv_transfer.labels("read").observe(now() - t)
        payload = payload_from_protos(blocks, hashes, self.block_size, num_in_store * self.block_size)
        if payload is None:
            return None, 0
        self.metrics.kvstore_imported.inc(payload.num_tokens)
        return payload, len(payload.block_hashes)

    def _run(self, req: AdmittedRequest, imported: KVPayload | None, context) -> RequestOutput:
        stream = self.loop.submit(req.req_id, req.prompt_token_ids, req.params, mode=RequestMode.PREFILL_ONLY,
                                  kv_import=imported, priority=req.priority)
        self.abort_when_caller_leaves(req.req_id, context)
        final = None
        while (out := stream.get()) is not None:
            final = out
        if final is None or final.finish_reason == RequestStatus.FINISHED_ABORTED.value:
            self.metrics.requests.labels("aborted").inc()
            context.abort(grpc.StatusCode.CANCELLED, f"request {req.req_id} was aborted")
        return final

    def _response(self, req_id: str, final: RequestOutput) -> prefill_pb2.PrefillResponse:
        # on the wire, no finish reason means "a decode worker goes on"
        finish = "" if final.finish_reason == _HANDOFF else final.finish_reason
        response = prefill_pb2.PrefillResponse(
            req_id=req_id, first_token_id=final.token_ids[0], text=final.text, finish_reason=finish,
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
            self.kvstore.release_lease_quietly(handle.lease_id)
            handle.lease_id = ""
        self.metrics.kv_transfer.labels("write").observe(now() - t)
        return handle

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
