"""Resuming a request on another decode worker when its stream breaks mid-way (as NVIDIA
Dynamo's request migration): the router holds every token it has sent, so the new worker
is asked to continue after them, and the client's stream goes on as if nothing happened.

    decode D1:  t1 t2 t3 ✗  (killed: UNAVAILABLE; hung: a poll finds it lost)
    decode D2:  DecodeRequest(prompt, output_token_ids=[t0 t1 t2 t3]) ─▶ t4 t5 ... final
                D2 imports what the kvstore still holds of the prompt, computes the rest,
                and replays t0..t3 through its detokenizer: its first text continues the
                last text sent (held-back stop-string prefixes included)

Greedy and seeded requests give exactly the tokens of an uninterrupted run: a seeded draw
depends only on (seed, position), never on which worker samples (engine/sample). The
resumed DecodeRequest is built where every DecodeRequest is (decode_request.py). A worker's
clear answer about the request itself (INVALID_ARGUMENT, ...) and the client's own cancel
or deadline end the request instead; so does a third break (MAX_MIGRATIONS).
"""
from __future__ import annotations

import grpc

MAX_MIGRATIONS = 2  # resumes per request: a request that breaks every worker it meets is not chased around

# why a stream that broke after sending tokens may move on: router_migrations_total{reason}
_REASONS = {grpc.StatusCode.UNAVAILABLE: "unavailable", grpc.StatusCode.UNKNOWN: "worker_error",
            grpc.StatusCode.INTERNAL: "worker_error", grpc.StatusCode.CANCELLED: "worker_aborted",
            grpc.StatusCode.ABORTED: "worker_aborted"}


class StreamFailure(grpc.RpcError):
    """A decode stream that failed without a gRPC error of its own; it reads as one
    (code, details), so retries and migrations treat every failure alike."""
    code_ = grpc.StatusCode.INTERNAL
    reason = "incomplete_stream"

    def __init__(self, details: str):
        super().__init__(details)
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self.code_

    def details(self) -> str:
        return self._details

    def trailing_metadata(self):
        return ()


class IncompleteStream(StreamFailure):
    """The stream ended without its final message (finish_reason)."""

    def __init__(self, address: str):
        super().__init__(f"decode worker {address} ended the stream without finishing")


class LostStream(StreamFailure):
    """A poll found the worker unreachable while its stream was open (calls.WorkerLost)."""
    code_ = grpc.StatusCode.UNAVAILABLE
    reason = "worker_lost"


def migration_reason(failure: grpc.RpcError) -> str | None:
    """The metric label of a failure a request may migrate after; None: it may not."""
    if isinstance(failure, StreamFailure):
        return failure.reason
    return _REASONS.get(failure.code())
