"""One request's way through the pools, with retries and cancellation.

    direct:        decode(prompt) ──────────────────────────────▶ stream
    disaggregated: prefill(prompt) ─▶ first token ─▶ decode(first, KVHandle) ─▶ stream
                   │                  (sent at once)  ▲
                   └ lease pinned in the kvstore ─────┘ released by the decode when it
                     takes over; by the router if the request ends before that

Retries (attempts.py): a failed prefill is retried once on another prefill worker; a
failed decode is retried once on another decode worker if it had not streamed anything yet
(the KV is still leased in the kvstore). A decode stream that breaks after tokens went out
is resumed on another decode worker after the tokens sent (migration.py). With no prefill
worker reachable (before the request, or after its prefill calls failed and nothing was
sent), or the kvstore down, a decode worker prefills the prompt itself: the direct path.
With no decode worker reachable nothing is prefilled: the request fails at once.

A worker of both roles is in both pools: a disaggregated request's prefill avoids the
decode worker its path was chosen for, and its decode avoids the worker that prefilled it,
so no worker hands a prompt over to itself while another can take its part (with none
left, as when the others went down since the choice, it does: slower, still exact).

A request with n > 1 completions takes the same path with the prompt prefilled once; each
completion then goes on as a request of its own, all merged into one stream. What differs
with n is decided once per request (completions.py, parallel.py); the steps here are the
same for any n: one prefill answers one first token per completion (PrefillResponse.choices),
and each choice either ends its completion or is handed off to a decode.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from functools import partial

import grpc

from pdserve.services.pb import common_pb2, prefill_pb2
from pdserve.services.router.core.attempts import Attempts
from pdserve.services.router.core.calls import WorkerCalls
from pdserve.services.router.core.cancel import Cancellation
from pdserve.services.router.core.choices import completion
from pdserve.services.router.core.completions import Completions, Lease, completions_for
from pdserve.services.router.core.decode_request import Handoff, decode_request, resumed_request
from pdserve.services.router.core.pools import Pool
from pdserve.services.router.core.request import RoutedRequest
from pdserve.services.router.core.stream import ResponseStream
from pdserve.services.router.decide.paths import DIRECT, NO_PREFILL_WORKER, RESUMED, PathPolicy, PoolsNow
from pdserve.services.router.errors import RouterError
from pdserve.services.router.metrics import RouterMetrics
from pdserve.services.router.state.discovery import DECODE, PREFILL


class GenerateFlow:
    def __init__(self, pools: dict[str, Pool], paths: PathPolicy, calls: WorkerCalls, metrics: RouterMetrics,
                 kvstore_address: str, retry_after_ms: int, min_class_ttft_ms: float = 0.0):
        """`min_class_ttft_ms`: for the prefill requests (Attempts)."""
        self.pools = pools
        self.paths = paths
        self.calls = calls
        self.metrics = metrics
        self.kvstore_address = kvstore_address
        self.attempts = Attempts(pools, calls, metrics, retry_after_ms, min_class_ttft_ms)

    def run(self, req: RoutedRequest, arrival: float, cancel: Cancellation,
            time_left: Callable[[], float | None]) -> Iterator[common_pb2.GenerateResponse]:
        """Raises RouterError (the client's error) or Cancelled. With n > 1 the messages of
        the n completions come interleaved, each tagged with its index (choices.py)."""
        if req.resumed_token_ids:
            yield from self._resumed(req, arrival, cancel, time_left)
            return
        req = self._choose_path(req)
        completions = completions_for(req, self.attempts)
        outs = self._streams(req, arrival)
        if req.path == DIRECT:
            yield from completions.direct(req, outs, cancel, time_left)
            return
        try:
            yield from self._disaggregated(req, completions, outs, cancel, time_left)
        except RouterError as e:
            # every prefill worker failed before anything was sent: slower, not lost
            if (e.code != grpc.StatusCode.UNAVAILABLE or any(out.num_tokens for out in outs)
                    or self.pools[PREFILL].up_workers()):
                raise
            req = self._without_prefill_pool(req)
            yield from completions.direct(req, self._streams(req, arrival), cancel, time_left)

    def _resumed(self, req: RoutedRequest, arrival: float, cancel: Cancellation, time_left):
        """A stream the client resumes after the tokens it has (its router died): a decode
        worker computes the prompt and those tokens and streams what follows, as a
        migration does (migration.py). The stream counts them as sent: its usage, and a
        migration of its own, continue after them."""
        req = replace(req, path=DIRECT)
        self.metrics.paths.labels(DIRECT, RESUMED).inc()
        out = self._streams(req, arrival)[0]
        out.token_ids.extend(req.resumed_token_ids)
        request = resumed_request(decode_request(req), list(req.resumed_token_ids), kvstore_up=False)
        yield from self.attempts.decode(req, request, len(req.prompt_token_ids) + len(req.resumed_token_ids), out,
                                        cancel, time_left)

    def _streams(self, req: RoutedRequest, arrival: float) -> list[ResponseStream]:
        """One per completion (n), each labelled with the request's own id."""
        return [ResponseStream(completion(req, i), arrival, self.metrics, req.req_id) for i in range(req.n)]

    def _choose_path(self, req: RoutedRequest) -> RoutedRequest:
        pools = PoolsNow(self.pools[PREFILL].up_workers(), self.pools[DECODE].up_workers(),
                         self.attempts.kvstore_up())
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

    def _disaggregated(self, req, completions: Completions, outs: list[ResponseStream], cancel, time_left):
        """The prompt prefilled once; each completion's first token sent at once, and those
        handed off continued by a decode, which reads the KV under the prefill's lease."""
        self.pools[DECODE].require_reachable()  # no prefill for a request no decode could finish
        reply, prefilled_on = self.attempts.prefill(req, outs[0], cancel, time_left)
        handed_off = [i for i, first in enumerate(reply.choices) if first.handoff]
        address = reply.kv_handle.kvstore_address or self.kvstore_address
        # no hand-off, no lease to release: a prefill that ended every completion kept none
        lease = completions.lease(partial(self.calls.release_lease, address),
                                  reply.kv_handle.lease_id if handed_off else "", len(handed_off))
        try:  # released however the request ends, at the latest (the client may go away)
            _check_choices(reply, req.n)
            for out in outs:
                out.first_call = outs[0].first_call  # the request's queue time, observed once
                yield out.first_from_prefill(reply)
            handoffs = {i: Handoff(reply.choices[i].token_id, reply.kv_handle, completions.shared_lease)
                        for i in handed_off}
            runs = [partial(self._continue, outs[i], handoff, lease, prefilled_on, time_left)
                    for i, handoff in handoffs.items()]
            yield from completions.side_by_side(runs, cancel)
        finally:
            lease.release()

    def _continue(self, out: ResponseStream, handoff: Handoff, lease: Lease, prefilled_on: str, time_left,
                  cancel: Cancellation):
        """One completion's decode from its first token; its first message says it has read
        the KV. `prefilled_on` is avoided: no worker hands a prompt over to itself."""
        read = False
        try:
            for msg in self.attempts.decode(out.req, decode_request(out.req, handoff), 0, out, cancel, time_left,
                                            avoid=prefilled_on):
                if not read:
                    read = True
                    lease.read()
                yield msg
        finally:
            if not read:
                lease.not_read()


def _check_choices(reply: prefill_pb2.PrefillResponse, n: int) -> None:
    """One choice per completion, each ending it or handed off: the prefill contract."""
    if len(reply.choices) != n:
        raise RouterError(grpc.StatusCode.INTERNAL, f"the prefill worker answered {len(reply.choices)} "
                                                    f"first tokens for n {n}")
    for i, first in enumerate(reply.choices):
        if first.handoff == bool(first.finish_reason):
            raise RouterError(grpc.StatusCode.INTERNAL, f"the prefill worker's first token {i} neither ends "
                                                        f"its completion nor is handed off, or both")
