"""The prefill worker: prefill-only requests of the engine behind PrefillWorker.Prefill.

    1. a lease, its write pending; lookup: the longest run of the prompt's block hashes
       already in the kvstore, pinned by the lease
    2. import those blocks (minus what the local prefix cache has), compute the rest
    3. answer with the first token and the KVHandle at once; local blocks are already free
    4. in the background: write the new full blocks and the tail block under the lease,
       then end its write (done or failed)

    prefill  ──lease──lookup──[ compute ]──first token + handle──▶ router ──▶ decode
                                          └─ write ─ end_write ┐              │
    kvstore                                                    └──▶ Get(lease, wait) returns

The first token never waits for the KV write: the decode's read waits on the lease
instead, which it reaches later anyway (the router streams the first token first). A
write that fails leaves the lease "failed": the decode recomputes what it cannot read.

The engine ends each request after its first token (RequestMode.PREFILL_ONLY): with a
real finish reason when that token ends it, else as a hand-off carrying the prompt's KV
(FirstToken.handoff on the wire). The engine runs the prompt's n completions (its full blocks
computed once, engine/parallel_sampling.py), each sampling its own first token: one
PrefillResponse.choices entry each, n = 1 included; the prompt's KV is written once, under
one lease, and every decode that continues a completion reads that one handle.
"""
from __future__ import annotations

import logging
import secrets
from concurrent.futures import ThreadPoolExecutor

import grpc

from pdserve.engine.engine_request import EngineRequest
from pdserve.engine.errors import EngineDeadError
from pdserve.engine import RequestOutput
from pdserve.engine.kv_transfer import KVPayload
from pdserve.engine.request import RequestMode, RequestStatus
from pdserve.engine.slo import NO_SLO, SLOTargets
from pdserve.services.common.convert import logprob_to_proto, prompt_logprobs_to_proto
from pdserve.services.kvstore.client import KVStoreClient
from pdserve.services.pb import common_pb2, prefill_pb2, prefill_pb2_grpc
from pdserve.services.worker.config import WorkerConfig
from pdserve.services.worker.engine_loop import EngineLoop
from pdserve.services.worker.kv_wire import payload_from_batches, payload_to_put
from pdserve.services.worker.metrics import WorkerMetrics
from pdserve.services.worker.runtime import RunningWorker, WorkerService, serve_worker
from pdserve.services.worker.servicer import AdmittedRequest, WorkerServicer, now, slo_of

logger = logging.getLogger(__name__)
_HANDOFF = RequestStatus.FINISHED_HANDOFF.value
# Background KV writes at once: more than one, so a slow write does not queue the next
# request's behind it; few, since each already moves bytes at the transport's speed.
NUM_KV_WRITERS = 2
# On shutdown, after the server's grace: how long calls it cut may take to leave their
# handlers (they are aborted in the engine at once; this only bounds a stuck one).
HANDLER_EXIT_S = 10.0


class PrefillServicer(WorkerServicer, prefill_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, cfg: WorkerConfig, loop: EngineLoop, metrics: WorkerMetrics, kvstore: KVStoreClient):
        super().__init__(cfg, loop, metrics, kvstore)
        self._writes = ThreadPoolExecutor(NUM_KV_WRITERS, thread_name_prefix="kv-write")

    def Prefill(self, request: prefill_pb2.PrefillRequest, context) -> prefill_pb2.PrefillResponse:
        with self.in_flight:  # counted until it returns: close() waits for it
            return self._prefill(request, context)

    def _prefill(self, request: prefill_pb2.PrefillRequest, context) -> prefill_pb2.PrefillResponse:
        req = self.admit(request, context)
        slo = slo_of(context, request.slo)
        # the last prompt token is always computed here: it samples the first token
        hashes = self.loop.info.prompt_block_hashes(req.prompt_token_ids, req.cache_salt)[
            : (len(req.prompt_token_ids) - 1) // self.block_size]
        t = now()
        lease_id = self._create_lease(req.req_id)
        lease_s, handed_over = now() - t, False
        try:
            # a request wanting its prompt's logprobs computes every prompt token: nothing to read
            wanted = hashes if req.params.prompt_logprobs is None else []
            imported, num_in_store = self._import_prefix(wanted, lease_id, req.cache_salt)
            # what is left of its TTFT budget once admitted and its prefix read: the engine's deadline
            finals = self._run(req, imported, context, slo.spent(now() - req.start))
            response = self._response(req, finals)
            # n > 1: the first completion to hand off carries the shared prompt's KV, one write for all
            kv_export = next((f.kv_export for f in finals if f.kv_export is not None), None)
            # the router gone: nobody would read or release, so nothing is written
            if kv_export is not None and context.is_active():
                t = now()
                response.kv_handle.CopyFrom(self._hand_over(req.req_id, kv_export, num_in_store, lease_id,
                                                             req.cache_salt))
                handed_over = bool(lease_id)
                # what the KV costs the first token: the lease, and queueing the write
                response.timings.kv_write_s = lease_s + now() - t
        finally:
            if not handed_over:
                self.kvstore.release_lease_quietly(lease_id)
        self._observe(finals, req.start, response)
        return response

    def _create_lease(self, req_id: str) -> str:
        """A lease whose write is pending; "" when the store cannot be reached (the prompt
        is then computed whole and nothing written: its decode recomputes)."""
        try:
            return self.kvstore.create_lease(self.cfg.lease_ttl_ms, req_id, write_pending=True)
        except grpc.RpcError as e:
            logger.warning("kvstore lease for %s failed (%s); not using the kvstore", req_id, e.code())
            self.metrics.kv_write_failures.inc()
            return ""

    def _import_prefix(self, hashes: list[bytes], lease_id: str, cache_salt: str) -> tuple[KVPayload | None, int]:
        """Blocks the kvstore has beyond what this engine holds (its device prefix cache, then
        its host tier: docs/kv_tiers.md); and how many leading blocks the store holds (those
        need not be written again: the lookup pinned them by the lease, so they stay until
        the decode has read them)."""
        if not hashes or not lease_id:
            return None, 0
        try:
            num_in_store = self.kvstore.lookup(hashes, lease_id)
        except grpc.RpcError as e:  # a store that is down slows prefills, it does not fail them
            logger.warning("kvstore lookup failed (%s); computing the whole prompt", e.code())
            return None, 0
        num_local = self.loop.num_local_prefix_blocks(hashes)  # no wait for the loop: see there
        if num_in_store <= num_local:
            return None, num_in_store
        t = now()
        try:  # only what follows the local prefix: the engine has the rest
            wanted = hashes[num_local:num_in_store]
            read = payload_from_batches(self.kvstore.get_blocks(wanted), wanted, self.loop.info.kv_layout,
                                        first_block=num_local, keys=self.kv_keys, cache_salt=cache_salt)
        except grpc.RpcError as e:
            logger.warning("kvstore get failed (%s); computing the whole prompt", e)
            return None, 0
        self.metrics.kv_transfer.labels("read").observe(now() - t)
        if read.refused is not None:  # it and the blocks after it are computed here
            logger.warning("a kvstore block of the prompt was refused (%s); computing from there", read.refused)
            self.metrics.kv_blocks_rejected.labels(read.refused).inc()
        payload = read.payload
        if payload is None:
            return None, 0
        self.metrics.kvstore_imported.inc(payload.num_tokens - num_local * self.block_size)
        return payload, payload.end_block

    def _run(self, req: AdmittedRequest, imported: KVPayload | None, context,
             slo: SLOTargets = NO_SLO) -> list[RequestOutput]:
        """The final output of each of the request's n completions, by index."""
        try:
            stream = self.loop.submit(EngineRequest(
                req.req_id, req.prompt_token_ids, req.params, mode=RequestMode.PREFILL_ONLY, kv_import=imported,
                priority=req.priority, cache_salt=req.cache_salt, slo=slo))
        except EngineDeadError:
            self.abort_if_engine_dead(context)
            raise
        self.abort_when_caller_leaves(req.req_id, context)
        finals: list[RequestOutput | None] = [None] * req.params.n
        while (out := stream.get()) is not None:
            finals[out.index] = out  # each completion's last output is its final one
        for final in finals:
            self.end_if_aborted(final, req.req_id, context)
        return finals

    def _response(self, req: AdmittedRequest, finals: list[RequestOutput]) -> prefill_pb2.PrefillResponse:
        """One choice per completion, n = 1 included; the prompt's parts are completion 0's."""
        final = finals[0]
        response = prefill_pb2.PrefillResponse(req_id=req.req_id, num_cached_tokens=final.num_cached_tokens,
                                               choices=[_first_token(f) for f in finals])
        if final.prompt_logprobs is not None:
            response.prompt_logprobs.CopyFrom(prompt_logprobs_to_proto(final.prompt_logprobs,
                                                                       req.params.prompt_logprobs))
        return response

    def _hand_over(self, req_id: str, payload: KVPayload, num_in_store: int, lease_id: str,
                   cache_salt: str) -> common_pb2.KVHandle:
        """The handle for the decode, and the write of the blocks the store does not hold
        yet, queued (under a lease; without one, the store was unreachable: no write)."""
        # unguessable: req_id may be the client's, and nobody else may write this request's tail
        tail_key = f"{req_id}/tail/{secrets.token_hex(8)}" if payload.num_tokens % self.block_size else ""
        handle = common_pb2.KVHandle(block_hashes=payload.block_hashes, tail_key=tail_key, lease_id=lease_id,
                                     num_tokens=payload.num_tokens, kvstore_address=self.cfg.kvstore_address)
        if lease_id:
            self._writes.submit(self._write_kv, req_id, payload, num_in_store, tail_key, lease_id, cache_salt)
        return handle

    def _write_kv(self, req_id: str, payload: KVPayload, num_in_store: int, tail_key: str, lease_id: str,
                  cache_salt: str) -> None:
        """In the background: the blocks, then the end of the lease's write. When the write
        fails (store full or down) the decode recomputes what it cannot read, so the request
        is slowed, not lost. When even end_write fails, the decode's wait runs out instead."""
        t = now()
        failed = False
        try:
            headers, data = payload_to_put(payload, self.loop.info.kv_layout, tail_key, skip_blocks=num_in_store,
                                           keys=self.kv_keys, cache_salt=cache_salt,
                                           out=self.kvstore.export_buffer if self.kv_keys else None)
            if headers:
                self.kvstore.put_blocks(headers, data, lease_id=lease_id)
        except grpc.RpcError as e:  # KVStoreFullError among them
            failed = True
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:  # the lease ended first (a cancel):
                logger.info("kvstore write for %s dropped: %s", req_id, e.details())  # nobody reads it
                return
            logger.warning("kvstore write for %s failed (%s); its decode will recompute", req_id, e)
            self.metrics.kv_write_failures.inc()
        except Exception:  # a bug: still end the write, or the decode waits for it in vain
            logger.exception("kvstore write for %s failed; its decode will recompute", req_id)
            self.metrics.kv_write_failures.inc()
            failed = True
        try:
            self.kvstore.end_write(lease_id, failed=failed)
        except grpc.RpcError as e:
            logger.warning("ending the kvstore write of %s failed (%s)", req_id, e.code())
        self.metrics.kv_transfer.labels("write").observe(now() - t)

    def finish(self) -> None:
        """The handlers still running end first (a call the server cut at its grace's end
        releases its lease, or queues its write), then the queued writes and their
        EndWrite (their decodes are waiting for them)."""
        if not self.in_flight.wait_idle(HANDLER_EXIT_S):
            logger.warning("%d prefill handlers still running at shutdown", self.in_flight.count)
        self._writes.shutdown(wait=True)

    def _observe(self, finals: list[RequestOutput], start: float, response: prefill_pb2.PrefillResponse) -> None:
        """One prefilled prompt, however many completions (n) it started: the first's times."""
        m, final = self.metrics, finals[0]
        queue_s = (final.first_scheduled_time or final.arrival_time) - final.arrival_time
        response.timings.prefill_queue_s = queue_s
        response.timings.prefill_s = final.first_token_time - (final.first_scheduled_time or final.arrival_time)
        m.first_token(final.first_token_time - final.arrival_time)
        m.prompt_computed(len(final.prompt_token_ids))
        # vLLM's count has the first token (a vLLM prefill instance's one token); pdserve's
        # decode_tokens_total counts the decode pool's tokens only
        m.vllm.generation_tokens.inc(sum(len(f.token_ids) for f in finals))
        m.request_done(now() - start, queue_s, final.finish_reason)


def _first_token(final: RequestOutput) -> prefill_pb2.FirstToken:
    handoff = final.finish_reason == _HANDOFF  # the engine's name for it; on the wire, its own field
    first = prefill_pb2.FirstToken(token_id=final.token_ids[0], text=final.text, handoff=handoff,
                                   finish_reason="" if handoff else final.finish_reason)
    if final.logprobs:
        first.logprob.CopyFrom(logprob_to_proto(final.logprobs[0]))
    return first


def prefill_service(cfg: WorkerConfig) -> WorkerService:
    return WorkerService("pdserve.v1.PrefillWorker", prefill_pb2_grpc.add_PrefillWorkerServicer_to_server,
                         lambda loop, metrics, kvstore: PrefillServicer(cfg, loop, metrics, kvstore))


def serve(cfg: WorkerConfig, loaded=None) -> RunningWorker:
    return serve_worker(cfg, loaded, "prefill", [prefill_service(cfg)])
