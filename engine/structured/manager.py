"""The engine's side of structured outputs: requests wait for their grammar off the step
loop, and each step gets the bitmask of the rows it samples under a grammar.

    add_request ──▶ WAITING_FOR_GRAMMAR (compiling on a thread; every other request runs)
    poll()      ──▶ compiled: a GrammarState advanced past the tokens already emitted
                    (a decode worker continuing a prefill's first token, a migrated
                    request), then the scheduler's queue; failed or too slow: an error
    bitmask()   ──▶ one row per request sampling this step, for the runner to apply
    accept()    ──▶ after sampling: the matcher advances (a preempted request keeps its
                    tokens and so its matcher: nothing to roll back)
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.engine.core.scheduler_output import SchedulerOutput
from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.structured.bitmask import GrammarBitmask
from pdserve.engine.structured.grammar import GrammarCompiler, GrammarState, allocate_bitmask
from pdserve.engine.structured.params import DEFAULT_COMPILE_TIMEOUT_S

logger = logging.getLogger(__name__)


@dataclass
class _Pending:
    request: Request
    future: object
    deadline: float


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids, compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S):
        self.compiler = GrammarCompiler(tokenizer, vocab_size, stop_token_ids, compile_timeout_s=compile_timeout_s)
        self.vocab_size = vocab_size
        self._pending: dict[str, _Pending] = {}
        self._bitmask = allocate_bitmask(1, vocab_size)

    # ---- waiting for grammars --------------------------------------------------------
    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING_FOR_GRAMMAR
        future = self.compiler.submit(request.sampling_params.structured_outputs)
        self._pending[request.req_id] = _Pending(request, future, time.monotonic() + self.compiler.compile_timeout_s)

    def remove(self, req_id: str) -> Request | None:
        pending = self._pending.pop(req_id, None)
        return pending.request if pending else None

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def poll(self) -> tuple[list[Request], list[tuple[Request, InvalidRequestError]]]:
        """Requests whose grammar is ready (status WAITING, for the scheduler), and those
        whose grammar failed or took too long, with the error."""
        ready, failed, now = [], [], time.monotonic()
        for req_id, pending in list(self._pending.items()):
            request, future = pending.request, pending.future
            if not future.done():
                if now > pending.deadline:
                    del self._pending[req_id]
                    kind = request.sampling_params.structured_outputs.kind
                    failed.append((request, InvalidRequestError(
                        f"structured_outputs.{kind}", f"did not compile within {self.compiler.compile_timeout_s:g} s")))
                continue
            del self._pending[req_id]
            error = future.exception()
            if error is None:
                error = self._start(request, future.result())
            if error is None:
                request.status = RequestStatus.WAITING
                ready.append(request)
            else:
                failed.append((request, error if isinstance(error, InvalidRequestError)
                               else InvalidRequestError("structured_outputs", str(error))))
        return ready, failed

    def _start(self, request: Request, compiled) -> InvalidRequestError | None:
        state = GrammarState(compiled)
        for i, token_id in enumerate(request.output_token_ids):
            if not state.accept(token_id):
                return InvalidRequestError("output_token_ids", f"token {i} ({token_id}) is not allowed by the "
                                                               "request's structured_outputs")
        request.grammar = state
        return None

    def for_guided(self) -> StructuredOutputManager:
        return self

    # ---- each step -------------------------------------------------------------------
    def step_bitmask(self, sched: SchedulerOutput, requests: dict[str, Request]) -> GrammarBitmask | None:
        """The bitmask of the scheduled requests that sample a token this step (their known
        tokens, and any drafts, are all computed by its end)."""
        drafts = sched.spec_token_ids
        sampling = [r for r in (requests.get(req_id) for req_id in sched.num_scheduled_tokens)
                    if r is not None and r.num_computed_tokens == r.num_tokens + len(drafts.get(r.req_id, ()))]
        return self.bitmask(sampling, drafts)

    def bitmask(self, sampling: list[Request], drafts: dict[str, list[int]]) -> GrammarBitmask | None:
        """The next-token bitmask of each request in `sampling` that has a grammar: one
        row, or with drafts one per scored position (the matcher walks the drafts, which
        check_drafts made sure it accepts, and is rolled back)."""
        guided = [r for r in sampling if r.grammar is not None]
        if not guided:
            return None
        num_rows = sum(1 + len(drafts.get(r.req_id, ())) for r in guided)
        if self._bitmask.shape[0] < num_rows:
            self._bitmask = allocate_bitmask(num_rows, self.vocab_size)
        rows, row = {}, 0
        for request in guided:
            grammar, ds = request.grammar, drafts.get(request.req_id, ())
            rows[request.req_id] = list(range(row, row + 1 + len(ds)))
            for j in range(len(ds) + 1):
                if grammar.terminated:  # after a draft that ends the grammar: the request stops there
                    self._bitmask[row].fill_(-1)
                else:
                    grammar.fill(self._bitmask, row)
                row += 1
                if j < len(ds):
                    grammar.accept(ds[j])
            if ds:
                grammar.rollback(len(ds))
        return GrammarBitmask(self._bitmask[:num_rows].clone(), rows)

    @staticmethod
    def check_drafts(request: Request, drafts: list[int]) -> list[int]:
        """The leading drafts the request's grammar allows (none past one that ends it);
        the matcher is left as it was."""
        if request.grammar is None or not drafts:
            return drafts
        allowed = 0
        for token_id in drafts:
            if not request.grammar.accept(token_id):
                break
            allowed += 1
            if request.grammar.terminated:
                break
        if allowed:
            request.grammar.rollback(allowed)
        return drafts[:allowed]

    @staticmethod
    def accept(request: Request, token_id: int) -> bool:
        """Advances the request's matcher past its sampled token; False if the grammar
        forbids it (a bug: the token was sampled under the grammar's mask)."""
        if request.grammar is None:
            return True
        if request.grammar.accept(token_id):
            return True
        logger.error("request %s sampled token %d, which its grammar forbids", request.req_id, token_id)
        return False

    def close(self) -> None:
        self.compiler.close()


class NoStructuredOutputs:
    """The engine's structured outputs until its first guided request: nothing waits for a
    grammar, nothing is masked. The real manager's tokenizer table takes ~0.3 s, so it is
    built only when a guided request comes (for_guided)."""
    num_pending = 0

    def __init__(self, build: Callable[[], StructuredOutputManager]):
        self._build = build

    def for_guided(self) -> StructuredOutputManager:
        return self._build()

    def remove(self, req_id: str) -> None:
        return None

    def poll(self) -> tuple[list[Request], list[tuple[Request, InvalidRequestError]]]:
        return [], []

    def step_bitmask(self, sched: SchedulerOutput, requests: dict[str, Request]) -> None:
        return None

    def close(self) -> None:
        pass
