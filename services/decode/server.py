"""The decode worker: the engine behind DecodeWorker.Decode.

A continuation (first_token_id + kv_handle; or a resumed request's output_token_ids,
whose handle may be empty or partly evicted) pulls its prompt's blocks from the kvstore on
the RPC thread while the engine keeps stepping, then joins the running batch as a
decode-only request with the KV imported; a block the store no longer has is recomputed
(the engine computes whatever the import does not cover). A short prompt (no handle) is
prefilled here: a colocated request, with DecodeRequest.n > 1 as n completions that share
the prompt's computation (engine/parallel_sampling.py), streamed interleaved by index.

Once a request has ended normally and its last message is streamed, its full blocks
(prompt + answer) go to the kvstore in the background, for the conversation's next turn
(services/worker/finished_kv.py; --no-kv-write-finished turns it off).
"""
from __future__ import annotations

import logging

import grpc

from pdserve.engine import InvalidRequestError, RequestOutput
from pdserve.engine.engine_request import EngineRequest
from pdserve.engine.errors import EngineDeadError
from pdserve.engine.kv_transfer import KVPayload
from pdserve.engine.request import RequestMode
from pdserve.services.common.convert import logprob_to_proto, prompt_logprobs_to_proto
from pdserve.services.decode.read_plan import ReadPlan, ReadRefusal, plan_read
from pdserve.services.pb import common_pb2, decode_pb2_grpc
from pdserve.services.kvstore.client import KVStoreClient
from pdserve.services.worker.config import WorkerConfig
from pdserve.services.worker.engine_loop import EngineLoop
from pdserve.services.worker.finished_kv import FinishedRequest, finished_kv_writer
from pdserve.services.worker.kv_wire import payload_from_batches
from pdserve.services.worker.metrics import WorkerMetrics
from pdserve.services.worker.runtime import RunningWorker, WorkerService, serve_worker
from pdserve.services.worker.servicer import AdmittedRequest, WorkerServicer, now, slo_of

logger = logging.getLogger(__name__)


class DecodeServicer(WorkerServicer, decode_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, cfg: WorkerConfig, loop: EngineLoop, metrics: WorkerMetrics, kvstore: KVStoreClient):
        super().__init__(cfg, loop, metrics, kvstore)
        # each finished request's prompt + answer, to the kvstore for its next turn
        self.finished_kv = finished_kv_writer(cfg, loop, kvstore, metrics)

    def Decode(self, request, context):
        with self.in_flight:  # until the stream ends: a draining worker waits for it
            yield from self._decode(request, context)

    def _decode(self, request, context):
        req = self.admit(request, context)
        slo = slo_of(context, request.slo)
        first = _tokens_given(request, context)
        continuation = bool(first)
        kv_import, kv_read_s = self._pull_kv(request, req, first) if continuation else (None, 0.0)
        mode = RequestMode.DECODE_ONLY if continuation else RequestMode.COLOCATED
        try:
            stream = self.loop.submit(EngineRequest(
                req.req_id, req.prompt_token_ids, req.params, mode=mode, output_token_ids=first, kv_import=kv_import,
                priority=req.priority, prefill_chunk_tokens=request.prefill_chunk_tokens, cache_salt=req.cache_salt,
                slo=slo))
        except InvalidRequestError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except EngineDeadError:
            self.abort_if_engine_dead(context)
        self.abort_when_caller_leaves(req.req_id, context)  # it may have left while the KV was pulled
        finals = yield from self._stream(stream, req, len(first), kv_read_s, context)
        num_in_store = kv_import.end_block if kv_import is not None else 0
        for final in finals:  # every completion ended normally (_stream ended the RPC otherwise)
            self.finished_kv.submit(FinishedRequest(req.req_id, final.prompt_token_ids + final.token_ids,
                                                    req.cache_salt, num_in_store))

    # ---- KV from the kvstore ---------------------------------------------------------
    def _pull_kv(self, request, req: AdmittedRequest, given: list[int]) -> tuple[KVPayload | None, float]:
        """The longest usable prefix of the handle's blocks (see read_plan and
        payload_from_batches), once the prefill's write under the lease has ended. Then the
        lease is released: the decode holds its own copy now. Whatever is not read is
        recomputed: slower, never lost."""
        tokens = req.prompt_token_ids + given
        hashes = self.loop.info.prompt_block_hashes(tokens, req.cache_salt)
        plan = plan_read(request.kv_handle, hashes, len(tokens), self.block_size, self.cfg.kvstore_address,
                         self.loop.num_local_prefix_blocks(hashes))
        if isinstance(plan, ReadRefusal):
            logger.warning("request %s: its KV handle names kvstore %r, this worker reads only %r; recomputing "
                           "its prompt", req.req_id, request.kv_handle.kvstore_address, self.cfg.kvstore_address)
            self.metrics.kv_blocks_rejected.labels(plan.reason).inc(plan.num_asked)
            self.metrics.recompute.inc(plan.num_asked)
            return None, 0.0
        if plan is None:
            return None, 0.0
        if plan.names_other_blocks:
            logger.warning("request %s: its KV handle names other blocks than its prompt's; reading the prompt's",
                           req.req_id)
        return self._fetch(plan, req.req_id, req.cache_salt, keep_lease=request.shared_lease)

    def _fetch(self, plan: ReadPlan, req_id: str, cache_salt: str, keep_lease: bool = False) -> tuple[KVPayload | None, float]:
        """`keep_lease`: the lease is shared with the decodes of sibling completions (n > 1):
        the router releases it once all of them have read."""
        t = now()
        try:
            batches = self.kvstore.get_blocks(plan.block_hashes, plan.tail_keys, lease_id=plan.lease_id,
                                              wait_ms=plan.wait_ms)
            read = payload_from_batches(batches, plan.block_hashes, self.loop.info.kv_layout, plan.tail_key,
                                        plan.num_tail_tokens, plan.first_block, self.kv_keys, cache_salt)
        except grpc.RpcError as e:
            logger.warning("kvstore read for %s failed (%s); recomputing its prompt", req_id, e)
            self.metrics.recompute.inc(plan.num_asked)
            return None, now() - t
        finally:
            if not keep_lease:
                self.kvstore.release_lease_quietly(plan.lease_id)
        if read.refused is not None:  # it and the blocks after it are recomputed
            logger.warning("request %s: a kvstore block was refused (%s); recomputing from there", req_id, read.refused)
            self.metrics.kv_blocks_rejected.labels(read.refused).inc()
        payload = read.payload
        self.metrics.recompute.inc(plan.num_asked - (payload.num_blocks if payload is not None else 0))
        seconds = now() - t
        self.metrics.kv_transfer.labels("read").observe(seconds)
        if payload is not None:
            self.metrics.kvstore_imported.inc(payload.num_tokens - payload.first_block * self.block_size)
        return payload, seconds

    # ---- streaming -------------------------------------------------------------------
    def _stream(self, stream, req: AdmittedRequest, num_given: int, kv_read_s: float, context):
        """Every completion's messages (n > 1: interleaved, tagged with their index) until
        each has ended; returns their final outputs, once all ended normally (else the RPC
        is ended: context.abort raises)."""
        last_token_time: dict[int, float] = {}
        finals: dict[int, RequestOutput] = {}  # each completion's latest output
        refused = None
        try:
            while (out := stream.get()) is not None:
                if out.error:  # the engine refused the request: INVALID_ARGUMENT below, no final message
                    refused = out
                    break
                t = now()
                if out.index in last_token_time:
                    self.metrics.token_gap(t - last_token_time[out.index])
                elif num_given == 0:
                    self.metrics.first_token(t - req.start)
                last_token_time[out.index] = t
                self.metrics.tokens_generated(len(out.new_token_ids))
                msg = self._message(out, req.req_id, kv_read_s)
                if out.index not in finals and out.prompt_logprobs is not None:  # computed here (direct): once
                    msg.prompt_logprobs.CopyFrom(prompt_logprobs_to_proto(out.prompt_logprobs,
                                                                          req.params.prompt_logprobs))
                finals[out.index] = out
                yield msg
        finally:
            if refused is not None or len(finals) < req.params.n or not all(f.finished for f in finals.values()):
                self.loop.abort(req.req_id)  # closed early (the caller went away): every completion
        for index in range(req.params.n):
            self.end_if_aborted(refused or finals.get(index), req.req_id, context)
        final = finals[0]
        if num_given == 0:  # the direct path: this worker prefilled the prompt itself (once for all n)
            self.metrics.prompt_computed(len(final.prompt_token_ids))
        self.metrics.request_done(now() - req.start, (final.first_scheduled_time or final.arrival_time)
                                  - final.arrival_time, final.finish_reason)
        return [finals[index] for index in range(req.params.n)]

    def finish(self) -> None:
        """The finished requests' writes still queued (they need the engine loop and the
        kvstore, which stop after this)."""
        self.finished_kv.close()

    def _message(self, out: RequestOutput, req_id: str, kv_read_s: float) -> common_pb2.GenerateResponse:
        msg = common_pb2.GenerateResponse(req_id=req_id, token_ids=out.new_token_ids, text=out.new_text,
                                          index=out.index)
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


def _tokens_given(request, context) -> list[int]:
    """The tokens emitted before this call: the prefill's first token, or every token a
    resumed request already streamed (a migration)."""
    if request.output_token_ids:
        if request.HasField("first_token_id"):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "output_token_ids: a resumed request gives every emitted token there, not first_token_id")
        return list(request.output_token_ids)
    return [request.first_token_id] if request.HasField("first_token_id") else []


def decode_service(cfg: WorkerConfig) -> WorkerService:
    return WorkerService("pdserve.v1.DecodeWorker", decode_pb2_grpc.add_DecodeWorkerServicer_to_server,
                         lambda loop, metrics, kvstore: DecodeServicer(cfg, loop, metrics, kvstore))


def serve(cfg: WorkerConfig, loaded=None) -> RunningWorker:
    return serve_worker(cfg, loaded, "decode", [decode_service(cfg)])
