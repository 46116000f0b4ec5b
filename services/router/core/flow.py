"""One request's way through the pools, with retries and cancellation.

    direct:        decode(prompt) ──────────────────────────────▶ stream
    disaggregated: prefill(prompt) ─▶ first token ─▶ decode(first, KVHandle) ─▶ stream
                   │                  (sent at once)  ▲
                   └ lease pinned in the kvstore ─────┘ released by the decode when it
                     takes over; by the router if the request ends before that

Retries: a failed prefill is retried once on another prefill worker; a failed decode is
retried once on another decode worker if it had not streamed anything yet (the KV is
still leased in the kvstore). A decode stream that breaks after tokens went out is resumed
on another decode worker after the tokens sent (migration.py). With no prefill worker
reachable (before the request, or after its prefill calls failed and nothing was sent), or
the kvstore down, a decode worker prefills the prompt itself: the direct path. With no
decode worker reachable nothing is prefilled: the request fails at once.

A worker of both roles is in both pools: a disaggregated request's prefill avoids the
decode worker its path was chosen for, and its decode avoids the worker that prefilled it,
so no worker hands a prompt over to itself while another can take its part (with none
left, as when the others went down since the choice, it does: slower, still exact).

A request with n > 1 completions takes the same path with the prompt prefilled once; each
completion then goes on as a request of its own, all merged into one stream (choices.py).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from functools import partial

import grpc

from pdserve.services.pb import common_pb2, decode_pb2, prefill_pb2
from pdserve.services.router.core.calls import RETRYABLE, WORKER_DOWN, WorkerCalls
from pdserve.services.router.core.cancel import Cancellation
from pdserve.services.router.core.choices import SharedLease, completion, merged
from pdserve.services.router.core.migration import (MAX_MIGRATIONS, IncompleteStream, StreamFailure, migration_reason,
                                                    resumed_request)
from pdserve.services.router.core.pools import Need, Pool
from pdserve.services.router.core.request import RoutedRequest
from pdserve.services.router.core.stream import ResponseStream
from pdserve.services.router.decide.paths import NO_PREFILL_WORKER, PathPolicy, PoolsNow
from pdserve.services.router.decide.paths import DIRECT
from pdserve.services.router.errors import RouterError, retry_after_from
from pdserve.services.router.metrics import RouterMetrics
from pdserve.services.router.state.discovery import DECODE, PREFILL

MAX_ATTEMPTS = 2  # the first call and one retry


class GenerateFlow:
    def __init__(self, pools: dict[str, Pool], paths: PathPolicy, calls: WorkerCalls, metrics: RouterMetrics,
                 kvstore_address: str, retry_after_ms: int, min_class_ttft_ms: float = 0.0):
        """`min_class_ttft_ms`: the tightest TTFT target of this router's SLO classes; each
        prefill request carries it, so the worker sizes its steps to what a newcomer may need."""
        self.pools = pools
        self.paths = paths
        self.calls = calls
        self.metrics = metrics
        self.kvstore_address = kvstore_address
        self.retry_after_ms = retry_after_ms
        self.min_class_ttft_ms = min_class_ttft_ms

    def run(self, req: RoutedRequest, arrival: float, cancel: Cancellation,
            time_left: Callable[[], float | None]) -> Iterator[common_pb2.GenerateResponse]:
        """Raises RouterError (the client's error) or Cancelled. With n > 1 the messages of
        the n completions come interleaved, each tagged with its index (choices.py)."""
        req = self._choose_path(req)
        outs = self._streams(req, arrival)
        if req.path == DIRECT:
            yield from self._direct(req, outs, cancel, time_left)
            return
        try:
            yield from self._disaggregated(req, outs, cancel, time_left)
        except RouterError as e:
            # every prefill worker failed before anything was sent: slower, not lost
            if (e.code != grpc.StatusCode.UNAVAILABLE or any(out.num_tokens for out in outs)
                    or self.pools[PREFILL].up_workers()):
                raise
            req = self._without_prefill_pool(req)
            yield from self._direct(req, self._streams(req, arrival), cancel, time_left)

    def _streams(self, req: RoutedRequest, arrival: float) -> list[ResponseStream]:
        """One per completion (n), each labelled with the request's own id."""
        return [ResponseStream(completion(req, i), arrival, self.metrics, req.req_id) for i in range(req.n)]

    def _choose_path(self, req: RoutedRequest) -> RoutedRequest:
        pools = PoolsNow(self.pools[PREFILL].up_workers(), self.pools[DECODE].up_workers(), self._kvstore_up())
        choice = self.paths.choose(len(req.prompt_token_ids), req.slo_class, pools)
        self.metrics.paths.labels(choice.path, choice.reason).inc()
        if choice.reason == NO_PREFILL_WORKER:
            self.metrics.prefill_fallbacks.inc()
        return replace(req, path=choice.path, prefill_chunk_tokens=choice.prefill_chunk_tokens,
                       decode_address=choice.decode_address)

    def _without_prefill_pool(self, req: RoutedRequest) -> RoutedRequest:
        """No prefill worker is reachable: a decode worker prefills the prompt itself."""
        self.metrics.prefill_fallbacks.inc()
        return replace(req, path=DIRECT)

    def _direct(self, req, outs: list[ResponseStream], cancel, time_left):
        decode_req = decode_pb2.DecodeRequest(req_id=req.req_id, prompt_token_ids=req.prompt_token_ids,
                                              sampling=req.sampling, priority=req.slo.priority,
                                              slo=req.decode_slo(),
                                              prefill_chunk_tokens=req.prefill_chunk_tokens, cache_salt=req.cache_salt,
                                              n=req.n)
        if req.n > 1:
            yield from self._direct_completions(req, decode_req, outs, cancel, time_left)
            return
        yield from self._decode(req, decode_req, len(req.prompt_token_ids), outs[0], cancel, time_left)

    def _disaggregated(self, req, outs: list[ResponseStream], cancel, time_left):
        self.pools[DECODE].require_reachable()  # no prefill for a request no decode could finish
        if req.n > 1:
            yield from self._disaggregated_completions(req, outs, cancel, time_left)
            return
        out = outs[0]
        reply, prefilled_on = self._prefill(req, out, cancel, time_left)
        lease_id = reply.kv_handle.lease_id if not reply.finish_reason else ""
        taken = False  # whether a decode has taken the KV (and with it the lease) over
        try:
            yield out.first_from_prefill(reply)
            if reply.finish_reason:
                return
            decode_req = decode_pb2.DecodeRequest(
                req_id=req.req_id, prompt_token_ids=req.prompt_token_ids, sampling=req.sampling,
                priority=req.slo.priority, slo=req.decode_slo(), first_token_id=reply.first_token_id,
                kv_handle=reply.kv_handle, cache_salt=req.cache_salt)
            for msg in self._decode(req, decode_req, 0, out, cancel, time_left, avoid=prefilled_on):
                taken = True
                yield msg
        finally:  # also when the client went away (an exception or the generator closed)
            if lease_id and not taken:
                self.calls.release_lease(reply.kv_handle.kvstore_address or self.kvstore_address, lease_id)

    # ---- n > 1: the prompt once, then each completion (choices.py) ----------------------
    def _disaggregated_completions(self, req, outs: list[ResponseStream], cancel, time_left):
        """One prefill samples every completion's first token; the completions that go on
        decode side by side, each from its own first token and the one shared KV handle."""
        reply, prefilled_on = self._prefill(req, outs[0], cancel, time_left)
        going_on = [i for i, first in enumerate(reply.choices) if not first.finish_reason]
        address = reply.kv_handle.kvstore_address or self.kvstore_address
        lease = SharedLease(lambda lease_id: self.calls.release_lease(address, lease_id),
                            reply.kv_handle.lease_id, len(going_on))
        try:  # released however the request ends, at the latest
            if len(reply.choices) != req.n:
                raise RouterError(grpc.StatusCode.INTERNAL, f"the prefill worker answered {len(reply.choices)} "
                                                            f"first tokens for n {req.n}")
            for out in outs:
                out.first_call = outs[0].first_call  # the request's queue time, observed once
                yield out.first_from_prefill(reply)
            yield from merged([partial(self._decode_completion, outs[i], reply, lease, prefilled_on, time_left)
                               for i in going_on], cancel)
        finally:
            lease.release()

    def _decode_completion(self, out: ResponseStream, reply: prefill_pb2.PrefillResponse, lease: SharedLease,
                           prefilled_on: str, time_left, cancel: Cancellation):
        req = out.req
        decode_req = decode_pb2.DecodeRequest(
            req_id=req.req_id, prompt_token_ids=req.prompt_token_ids, sampling=req.sampling,
            priority=req.slo.priority, slo=req.decode_slo(), first_token_id=reply.choices[req.index].token_id,
            kv_handle=reply.kv_handle, cache_salt=req.cache_salt, shared_lease=True)
        read = False
        try:
            for msg in self._decode(req, decode_req, 0, out, cancel, time_left, avoid=prefilled_on):
                if not read:  # its first message: the decode has read the KV
                    read = True
                    lease.done_reading()
                yield msg
        finally:
            if not read:
                lease.done_reading()

    def _direct_completions(self, req, decode_req, outs: list[ResponseStream], cancel, time_left):
        """One decode worker computes the prompt once for the n completions and streams them
        interleaved; retried whole when it sent nothing, else each unfinished completion
        goes on alone on another worker (migration.py), after the tokens it sent."""
        failed: list[str] = []
        last_error: RouterError | None = None
        for attempt in range(MAX_ATTEMPTS):
            slot = self._acquire(DECODE, req, len(req.prompt_token_ids), failed, cancel, last_error)
            outs[0].dispatched()
            for out in outs[1:]:
                out.first_call = outs[0].first_call  # the request's queue time, observed once
            try:
                yield from self._stream_completions(slot.address, decode_req, outs, cancel, time_left)
                return
            except grpc.RpcError as e:
                failed.append(slot.address)
                num_sent = sum(out.num_tokens for out in outs)
                if not num_sent:  # nothing came from this call
                    last_error = self._failure(DECODE, slot.address, e, can_retry=attempt + 1 < MAX_ATTEMPTS)
                    continue
                reason = migration_reason(e)
                self._failure(DECODE, slot.address, e, can_retry=reason is not None, mid_stream=num_sent)
                break
            finally:
                slot.release()
        runs = [partial(self._resume_completion, out, decode_req, failed, reason, time_left)
                for out in outs if not out.finished]
        yield from merged(runs, cancel)

    def _stream_completions(self, address: str, decode_req, outs: list[ResponseStream], cancel, time_left):
        stream = self.calls.decode(address, decode_req, time_left(), cancel)
        try:
            for msg in stream:
                if msg.index >= len(outs):
                    raise StreamFailure(f"decode worker {address} sent completion {msg.index} of {len(outs)}")
                yield outs[msg.index].forward(msg)
        finally:
            stream.close()
        if not all(out.finished for out in outs):
            raise IncompleteStream(address)

    def _resume_completion(self, out: ResponseStream, decode_req, failed: list[str], reason: str, time_left,
                           cancel: Cancellation):
        """One completion of a broken direct stream, alone: seed + index, after its tokens sent."""
        req = out.req
        one = decode_pb2.DecodeRequest()
        one.CopyFrom(decode_req)
        one.req_id, one.n = req.req_id, 1
        one.sampling.CopyFrom(req.sampling)
        resumed = resumed_request(one, out.token_ids, self._kvstore_up())
        yield from self._decode(req, resumed, len(req.prompt_token_ids) + out.num_tokens, out, cancel, time_left,
                                failed=failed, migrating=reason)

    def _prefill(self, req: RoutedRequest, out: ResponseStream, cancel,
                 time_left) -> tuple[prefill_pb2.PrefillResponse, str]:
        """The prefill's reply and the worker that gave it."""
        request = prefill_pb2.PrefillRequest(req_id=req.req_id, prompt_token_ids=req.prompt_token_ids,
                                             sampling=req.sampling, priority=req.slo.priority,
                                             cache_salt=req.cache_salt, n=req.n)
        failed: list[str] = []
        last_error: RouterError | None = None
        for attempt in range(MAX_ATTEMPTS):
            slot = self._acquire(PREFILL, req, len(req.prompt_token_ids), failed, cancel, last_error,
                                 avoid=req.decode_address)
            try:
                # checked again after the admission wait: no decode worker may be left to finish it
                self.pools[DECODE].require_reachable()
                out.dispatched()
                # the class's TTFT target less the time spent here (queued, a failed attempt)
                request.slo.CopyFrom(req.prefill_slo(self.min_class_ttft_ms, time.monotonic() - out.arrival))
                return self.calls.prefill(slot.address, request, time_left(), cancel), slot.address
            except grpc.RpcError as e:
                last_error = self._failure(PREFILL, slot.address, e, can_retry=attempt + 1 < MAX_ATTEMPTS)
                failed.append(slot.address)
            finally:
                slot.release()
        raise AssertionError("unreachable: the last failure raises")

    def _decode(self, req, decode_req, num_prefill_tokens: int, out: ResponseStream, cancel, time_left,
                failed: list[str] = (), migrating: str | None = None, avoid: str = ""):
        """The decode stream, on another worker when a call fails: retried as is when the
        call sent nothing (MAX_ATTEMPTS), resumed after the tokens sent when it broke
        mid-way (MAX_MIGRATIONS). `failed`, `migrating`: a completion resumed alone after
        the stream it shared broke (_direct_completions). `avoid`: the worker that
        prefilled it (see _acquire)."""
        failed = list(failed)
        last_error: RouterError | None = None
        num_retries = 0
        num_migrations = int(migrating is not None)
        while True:
            slot = self._acquire(DECODE, req, num_prefill_tokens, failed, cancel, last_error, avoid=avoid)
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
                    last_error = self._failure(DECODE, slot.address, e, can_retry=num_retries < MAX_ATTEMPTS)
                    continue
                migrating = migration_reason(e) if num_migrations < MAX_MIGRATIONS else None
                last_error = self._failure(DECODE, slot.address, e, can_retry=migrating is not None,
                                           mid_stream=out.num_tokens)
                num_migrations += 1
                decode_req = resumed_request(decode_req, out.token_ids, self._kvstore_up())
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

    def _kvstore_up(self) -> bool:
        return self.pools[DECODE].registry.kvstore.up

    def _acquire(self, pool: str, req: RoutedRequest, num_prefill_tokens: int, failed: list[str],
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

    def _failure(self, pool: str, address: str, error: grpc.RpcError, can_retry: bool,
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
