"""Refusing a structured-output spec the workers could not run, before anything runs.

The router compiles each spec once with the same xgrammar compiler the workers use (its
tokenizer, the model's vocabulary size): a schema xgrammar rejects, a regex that does not
parse or a grammar that takes longer than `timeout_s` to compile is an INVALID_ARGUMENT /
400 naming `structured_outputs.<kind>`, and no worker ever sees the request.

    validate() ─▶ GrammarCheck.check ─▶ GrammarCompiler (built on the first spec, ~0.3 s)
                  waits ≤ timeout_s      └ compiles on its own thread, cached by spec

The wait happens on the caller's thread: a gRPC servicer thread or the HTTP API's thread
pool (fronts/http/app.py runs validation there), never the asyncio event loop. A compile that runs
past the timeout keeps going on the compiler's thread and its result is cached, so the
same spec sent again is answered at once.
"""
from __future__ import annotations

import threading

from pdserve.engine.structured import StructuredOutputsParams
from pdserve.engine.structured.grammar import GrammarCompiler


class GrammarCheck:
    def __init__(self, tokenizer, vocab_size: int | None, timeout_s: float):
        self._tokenizer, self._vocab_size, self.timeout_s = tokenizer, vocab_size, timeout_s
        self._lock = threading.Lock()
        self._compiler = None

    def check(self, params: StructuredOutputsParams) -> None:
        """Raises InvalidRequestError naming `structured_outputs.<kind>`."""
        self._get().check(params, timeout_s=self.timeout_s)

    def _get(self):
        with self._lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(self._tokenizer, self._vocab_size)
            return self._compiler
