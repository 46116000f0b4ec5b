"""What the prefill and decode servicers share: admission, the parse-and-validate prelude
of every request, the load report, leaving when the caller leaves, the epilogue of an
aborted request and the worker's one kvstore client."""
from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass

import grpc

from pdserve.engine import InvalidRequestError, RequestOutput, SamplingParams
from pdserve.engine.core.block_hash import check_cache_salt
from pdserve.engine.request import RequestStatus
from pdserve.engine.slo import SLOTargets
from pdserve.engine.stats import EngineStats
from pdserve.services.common.convert import sampling_from_proto, slo_from_proto
from pdserve.services.kvstore.client import KVStoreClient
from pdserve.services.pb import common_pb2
from pdserve.services.worker.config import WorkerConfig
from pdserve.services.worker.engine_loop import EngineLoop
from pdserve.services.worker.in_flight import InFlight
from pdserve.services.worker.metrics import WorkerMetrics


def now() -> float:
    return time.monotonic()


@dataclass(frozen=True)
class AdmittedRequest:
    """A request that passed admission and validation, as the servicers go on with it."""
    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    start: float  # when the worker took it (monotonic)
    cache_salt: str = ""  # shares cached KV only with requests of the same salt


def slo_of(context: grpc.ServicerContext, msg: common_pb2.SLOTargets) -> SLOTargets:
    """A request's SLO targets; INVALID_ARGUMENT naming the field as the caller sent it
    (slo.itl_target_ms) when one is negative, NaN or infinite."""
    try:
        return slo_from_proto(msg)
    except InvalidRequestError as e:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))


def load_to_proto(stats: EngineStats, max_num_seqs: int, draining: bool) -> common_pb2.WorkerLoad:
    """The engine's stats as the router reads them: the fields WorkerLoad shares, by name
    (a tuple of dataclasses as the repeated message of the same fields)."""
    shared = {f.name: getattr(stats, f.name) for f in common_pb2.WorkerLoad.DESCRIPTOR.fields
              if hasattr(stats, f.name)}
    shared["queued_prefill"] = [dataclasses.asdict(q) for q in stats.queued_prefill]
    return common_pb2.WorkerLoad(**shared, max_num_seqs=max_num_seqs, draining=draining)


class WorkerServicer:
    """The base of both servicers. RPC threads read the loop's `info` and `stats` only;
    everything that touches the engine goes through the loop."""

    def __init__(self, cfg: WorkerConfig, loop: EngineLoop, metrics: WorkerMetrics, kvstore: KVStoreClient):
        self.cfg, self.loop, self.metrics = cfg, loop, metrics
        self.kvstore = kvstore  # this worker's own (--kvstore): the only one it reads or writes
        self.kv_keys = cfg.kv_keys  # seal, encrypt and check every block it writes or reads
        self.block_size = loop.info.block_size
        self.draining = False
        # request handlers still running (a decode's until its stream ends): a draining
        # worker waits for them while it still answers polls and health checks
        self.in_flight = InFlight()

    def GetLoad(self, request, context) -> common_pb2.WorkerLoad:
        return load_to_proto(self.loop.stats, self.loop.info.max_num_seqs, self.draining)

    def admit(self, request, context: grpc.ServicerContext) -> AdmittedRequest:
        """Admission, then the request's fields parsed and validated as the engine would;
        aborts the RPC with the right code otherwise."""
        self._check_admission(context)
        start = now()
        prompt = list(request.prompt_token_ids)
        try:
            params = sampling_from_proto(request.sampling)
            if request.n > 1:  # the prompt's completions, computed once (engine/parallel_sampling.py)
                params = dataclasses.replace(params, n=request.n)
            self.loop.info.validate(prompt, params)
            if (problem := check_cache_salt(request.cache_salt)) is not None:
                raise InvalidRequestError("cache_salt", problem)
        except InvalidRequestError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return AdmittedRequest(request.req_id or uuid.uuid4().hex, prompt, params, request.priority, start,
                               request.cache_salt)

    def abort_when_caller_leaves(self, req_id: str, context: grpc.ServicerContext) -> None:
        if not context.add_callback(lambda: self.loop.abort(req_id)):  # (a no-op once the request is done)
            self.loop.abort(req_id)  # the caller already left

    def end_if_aborted(self, final: RequestOutput | None, req_id: str, context: grpc.ServicerContext) -> None:
        """Ends the RPC (context.abort raises) when the request ended aborted or without a
        single output: UNAVAILABLE for a dead engine, INVALID_ARGUMENT for a request the
        engine refused (a spec that does not compile), else CANCELLED. A caller already
        gone gets the same abort: it only ends the handler."""
        if final is not None and final.finish_reason != RequestStatus.FINISHED_ABORTED.value:
            return
        self.metrics.request_aborted()
        self.abort_if_engine_dead(context)
        if final is not None and final.error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, final.error)
        context.abort(grpc.StatusCode.CANCELLED, f"request {req_id} was aborted")

    def finish(self) -> None:
        """Drains the servicer's own background work (none here); the kvstore stays
        connected: a worker serving both roles shares it between two servicers."""

    def close(self) -> None:
        """Drains, then disconnects from the kvstore."""
        self.finish()
        self.kvstore.close()

    def abort_if_engine_dead(self, context: grpc.ServicerContext) -> None:
        """UNAVAILABLE once the engine cannot step (a tensor/pipeline rank died): the router
        takes the request elsewhere, as from a worker that went away, and this one exits."""
        if self.loop.dead.is_set() and context.is_active():
            context.abort(grpc.StatusCode.UNAVAILABLE, f"worker engine failed: {self.loop.dead_reason}")

    def _check_admission(self, context: grpc.ServicerContext) -> None:
        self.abort_if_engine_dead(context)
        if self.draining:
            context.abort(grpc.StatusCode.UNAVAILABLE, "worker is draining")
        num_waiting = self.loop.stats.num_waiting
        if num_waiting >= self.cfg.max_waiting:
            context.set_trailing_metadata((("retry-after-ms", "500"),))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"worker queue full ({num_waiting} waiting); retry later")
