"""Parallel sampling (n > 1) in the flow: what differs from one completion (completions.py).

    disaggregated: the prefill's n first tokens; each completion handed off decodes on a
                   thread of its own (choices.merged), all under the prefill's one lease
                   (choices.SharedLease), which the router releases once each has read
    direct:        one decode worker computes the prompt once and streams the n completions
                   interleaved, retried whole while it sent nothing; once it broke mid-way,
                   each unfinished completion goes on alone on another worker, after the
                   tokens it sent (seed + index: choices.completion)
"""
from __future__ import annotations

from functools import partial

import grpc

from pdserve.services.router.core.attempts import MAX_ATTEMPTS, Attempts
from pdserve.services.router.core.cancel import Cancellation
from pdserve.services.router.core.choices import SharedLease, merged
from pdserve.services.router.core.decode_request import decode_request, resumed_request
from pdserve.services.router.core.migration import IncompleteStream, StreamFailure, migration_reason
from pdserve.services.router.core.stream import ResponseStream
from pdserve.services.router.errors import RouterError
from pdserve.services.router.state.discovery import DECODE


class ParallelCompletions:
    shared_lease = True

    def __init__(self, attempts: Attempts):
        self.attempts = attempts

    def lease(self, release, lease_id, num_readers):
        return SharedLease(release, lease_id, num_readers)

    def side_by_side(self, runs, cancel):
        return merged(runs, cancel)

    def direct(self, req, outs: list[ResponseStream], cancel, time_left):
        """Retried whole when the call sent nothing; else each unfinished completion resumes alone."""
        decode_req = decode_request(req)
        failed: list[str] = []
        last_error: RouterError | None = None
        for attempt in range(MAX_ATTEMPTS):
            slot = self.attempts.acquire(DECODE, req, len(req.prompt_token_ids), failed, cancel, last_error)
            outs[0].dispatched()
            for out in outs[1:]:
                out.first_call = outs[0].first_call  # the request's queue time, observed once
            try:
                yield from self._stream(slot.address, decode_req, outs, cancel, time_left)
                return
            except grpc.RpcError as e:
                failed.append(slot.address)
                num_sent = sum(out.num_tokens for out in outs)
                if not num_sent:  # nothing came from this call
                    last_error = self.attempts.failure(DECODE, slot.address, e, can_retry=attempt + 1 < MAX_ATTEMPTS)
                    continue
                reason = migration_reason(e)
                self.attempts.failure(DECODE, slot.address, e, can_retry=reason is not None, mid_stream=num_sent)
                break
            finally:
                slot.release()
        runs = [partial(self._resume, out, failed, reason, time_left) for out in outs if not out.finished]
        yield from merged(runs, cancel)

    def _stream(self, address: str, decode_req, outs: list[ResponseStream], cancel, time_left):
        stream = self.attempts.calls.decode(address, decode_req, time_left(), cancel)
        try:
            for msg in stream:
                if msg.index >= len(outs):
                    raise StreamFailure(f"decode worker {address} sent completion {msg.index} of {len(outs)}")
                yield outs[msg.index].forward(msg)
        finally:
            stream.close()
        if not all(out.finished for out in outs):
            raise IncompleteStream(address)

    def _resume(self, out: ResponseStream, failed: list[str], reason: str, time_left, cancel: Cancellation):
        """One completion of a broken direct stream, alone: seed + index, after its tokens sent."""
        req = out.req
        resumed = resumed_request(decode_request(req), out.token_ids, self.attempts.kvstore_up())
        yield from self.attempts.decode(req, resumed, len(req.prompt_token_ids) + out.num_tokens, out, cancel,
                                        time_left, failed=failed, migrating=reason)
