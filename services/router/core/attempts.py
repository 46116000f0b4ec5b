"""Each worker call of a request, tried on another worker when it fails.

    prefill:  call ─✗─▶ call on another prefill worker ─✗─▶ the client's error
    decode:   call ─✗ (nothing sent)      ─▶ the same request on another decode worker
              call ─✗ (after tokens sent) ─▶ resumed after them on another (migration.py)

A failure first tells whether it is final (calls.RETRYABLE; a worker that went away is
marked down at once); the error the client gets when no retry is left is the last failure's,
never "no worker" for a pool emptied by the failures themselves.
"""
from __future__ import annotations

import time

import grpc

from pdserve.services.pb import prefill_pb2
from pdserve.services.router.core.calls import RETRYABLE, WORKER_DOWN, WorkerCalls
from pdserve.services.router.core.cancel import Cancellation
from pdserve.services.router.core.decode_request import resumed_request
from pdserve.services.router.core.migration import MAX_MIGRATIONS, IncompleteStream, migration_reason
from pdserve.services.router.core.pools import Need, Pool
from pdserve.services.router.core.request import RoutedRequest
from pdserve.services.router.core.stream import ResponseStream
from pdserve.services.router.errors import RouterError, retry_after_from
from pdserve.services.router.metrics import RouterMetrics
from pdserve.services.router.state.discovery import DECODE, PREFILL

MAX_ATTEMPTS = 2  # the first call and one retry


class Attempts:
    def __init__(self, pools: dict[str, Pool], calls: WorkerCalls, metrics: RouterMetrics, retry_after_ms: int,
                 min_class_ttft_ms: float = 0.0):
        """`min_class_ttft_ms`: the tightest TTFT target of this router's SLO classes; each
        prefill request carries it, so the worker sizes its steps to what a newcomer may need."""
        self.pools = pools
        self.calls = calls
        self.metrics = metrics
        self.retry_after_ms = retry_after_ms
        self.min_class_ttft_ms = min_class_ttft_ms

    def prefill(self, req: RoutedRequest, out: ResponseStream, cancel,
                time_left) -> tuple[prefill_pb2.PrefillResponse, str]:
        """The prefill's reply and the worker that gave it."""
        request = prefill_pb2.PrefillRequest(req_id=req.req_id, prompt_token_ids=req.prompt_token_ids,
                                             sampling=req.sampling, priority=req.slo.priority,
                                             cache_salt=req.cache_salt, n=req.n)
        failed: list[str] = []
        last_error: RouterError | None = None
        for attempt in range(MAX_ATTEMPTS):
            slot = self.acquire(PREFILL, req, len(req.prompt_token_ids), failed, cancel, last_error,
                                avoid=req.decode_address)
            try:
                # checked again after the admission wait: no decode worker may be left to finish it
                self.pools[DECODE].require_reachable()
                out.dispatched()
                # the class's TTFT target less the time spent here (queued, a failed attempt)
                request.slo.CopyFrom(req.prefill_slo(self.min_class_ttft_ms, time.monotonic() - out.arrival))
                return self.calls.prefill(slot.address, request, time_left(), cancel), slot.address
            except grpc.RpcError as e:
                last_error = self.failure(PREFILL, slot.address, e, can_retry=attempt + 1 < MAX_ATTEMPTS)
                failed.append(slot.address)
            finally:
                slot.release()
        raise AssertionError("unreachable: the last failure raises")

    def decode(self, req, decode_req, num_prefill_tokens: int, out: ResponseStream, cancel, time_left,
               failed: list[str] = (), migrating: str | None = None, avoid: str = ""):
        """The decode stream, on another worker when a call fails: retried as is when the
        call sent nothing (MAX_ATTEMPTS), resumed after the tokens sent when it broke
        mid-way (MAX_MIGRATIONS). `failed`, `migrating`: a completion resumed alone after
        the stream it shared broke (parallel.py). `avoid`: the worker that prefilled it
        (see acquire)."""
        failed = list(failed)
        last_error: RouterError | None = None
        num_retries = 0
        num_migrations = int(migrating is not None)
        while True:
            slot = self.acquire(DECODE, req, num_prefill_tokens, failed, cancel, last_error, avoid=avoid)
            if migrating is not None:
                self.metrics.migrations.labels(migrating).inc()
                migrating = None
            out.dispatched()
            num_sent = out.num_tokens
            try:
                yield from self._stream(slot.address, decode_req, out, cancel, time_left)
                return
            except grpc.RpcError as e:
                failed.append(slot.address)
                if out.num_tokens == num_sent:  # nothing came from this call
                    num_retries += 1
                    last_error = self.failure(DECODE, slot.address, e, can_retry=num_retries < MAX_ATTEMPTS)
                    continue
                migrating = migration_reason(e) if num_migrations < MAX_MIGRATIONS else None
                last_error = self.failure(DECODE, slot.address, e, can_retry=migrating is not None,
                                          mid_stream=out.num_tokens)
                num_migrations += 1
                decode_req = resumed_request(decode_req, out.token_ids, self.kvstore_up())
                num_prefill_tokens = len(req.prompt_token_ids) + out.num_tokens  # at most: what it recomputes
            finally:
                slot.release()

    def _stream(self, address: str, decode_req, out: ResponseStream, cancel, time_left):
        stream = self.calls.decode(address, decode_req, time_left(), cancel)
        try:
            for msg in stream:
                yield out.forward(msg)
        finally:
            stream.close()  # cancels the call when the client went away mid-stream
        if not out.finished:  # the client must learn that its answer is incomplete
            raise IncompleteStream(address)

    def kvstore_up(self) -> bool:
        return self.pools[DECODE].registry.kvstore.up

    def acquire(self, pool: str, req: RoutedRequest, num_prefill_tokens: int, failed: list[str],
                cancel: Cancellation, last_error: RouterError | None, avoid: str = ""):
        """A slot on the pool's best worker, never one in `failed`; nor `avoid` (the other
        end of a hand-off: a worker of both roles) while any other worker is up."""
        cancel.raise_if_cancelled()
        exclude = tuple(failed)
        if avoid and self.pools[pool].up_workers((*exclude, avoid)):
            exclude = (*exclude, avoid)
        need = Need(req.slo_class, req.slo.priority, req.slo.max_queue_ms / 1000, req.prompt_token_ids,
                    num_prefill_tokens, exclude)
        try:
            return self.pools[pool].acquire(need, cancel)
        except RouterError as e:
            if last_error is not None and e.code == grpc.StatusCode.UNAVAILABLE:
                raise last_error from None  # no other worker to retry on: report why the first failed
            raise

    def failure(self, pool: str, address: str, error: grpc.RpcError, can_retry: bool,
                mid_stream: int = 0) -> RouterError:
        """The error a failed call means for the client: raised when it is final, returned
        (and counted as a retry, unless the call broke after `mid_stream` tokens: a
        migration) when the request goes on to another worker."""
        code = error.code()
        if code in WORKER_DOWN:
            self.pools[pool].registry.mark_down(pool, address)
        retry_after = (retry_after_from(error, self.retry_after_ms)
                       if code == grpc.StatusCode.RESOURCE_EXHAUSTED else None)
        # a worker that aborted the request itself (not our client: see calls.py) is unavailable to it
        client_code = grpc.StatusCode.UNAVAILABLE if code == grpc.StatusCode.CANCELLED else code
        where = f" mid-stream after {mid_stream} tokens" if mid_stream else ""
        failure = RouterError(client_code, f"{pool} worker {address} failed{where}: {error.details()}", retry_after)
        if not can_retry or (code not in RETRYABLE and not mid_stream):
            raise failure
        if not mid_stream:
            self.metrics.retries.labels(pool).inc()
        return failure
