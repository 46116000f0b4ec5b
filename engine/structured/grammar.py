"""Grammars with xgrammar: compiled once per spec (cached), off the step loop, and one
matcher per request that says which tokens may come next.

    StructuredOutputsParams ──GrammarCompiler.submit──▶ Future[CompiledGrammar]   (a thread)
    CompiledGrammar ──GrammarState──▶ fill(bitmask row) before each sampled token
                                      accept(token) after it; rollback(n) for drafts

The bitmask has one bit per row of the model's vocabulary (its padded embedding rows,
which may outnumber the tokenizer's tokens): xgrammar is told the model's size and never
allows a token the tokenizer does not have.
"""
from __future__ import annotations

import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.structured.params import DEFAULT_COMPILE_TIMEOUT_S, StructuredOutputsParams

# Bounds on what a long-running server keeps per distinct spec: futures (each holding its
# compiled grammar) and xgrammar's own cache.
MAX_CACHED_SPECS = 1024
XGRAMMAR_CACHE_BYTES = 256 << 20


def _choice_grammar(choices) -> str:
    """EBNF accepting exactly one of the strings (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


class GrammarCompiler:
    """xgrammar's compiler for one tokenizer and vocabulary size, with a cache by spec
    and one compile thread. Thread-safe; built lazily (its tokenizer table takes ~0.3 s)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids=(), max_threads: int = 1,
                 compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S):
        self._tokenizer, self.vocab_size = tokenizer, vocab_size
        self._stop_token_ids = sorted(stop_token_ids) or None
        self._max_threads = max_threads
        self.compile_timeout_s = compile_timeout_s
        self._lock = threading.Lock()
        self._compiler = None
        self._futures: dict[tuple[str, str], Future] = {}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")

    def _xgr_compiler(self):
        import xgrammar as xgr
        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self._stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=self._max_threads, cache_enabled=True,
                                                     cache_limit_bytes=XGRAMMAR_CACHE_BYTES)
            return self._compiler

    def prepare(self) -> None:
        """Builds the tokenizer table now rather than on the first compile."""
        self._xgr_compiler()

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar, now (on the caller's thread); a spec xgrammar refuses
        raises InvalidRequestError naming `structured_outputs.<kind>`."""
        compiler, kind = self._xgr_compiler(), params.kind
        try:
            any_whitespace = not params.disable_any_whitespace
            if kind == "json":
                return compiler.compile_json_schema(params.spec_text, any_whitespace=any_whitespace)
            if kind == "json_object":  # OpenAI's json_object: an object, not any JSON value
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=any_whitespace)
            if kind == "regex":
                return compiler.compile_regex(params.regex)
            if kind == "choice":
                return compiler.compile_grammar(_choice_grammar(params.choice))
            return compiler.compile_grammar(params.grammar)
        except (RuntimeError, ValueError) as e:
            raise InvalidRequestError(f"structured_outputs.{kind}", f"does not compile: {_reason(e)}") from None

    def submit(self, params: StructuredOutputsParams) -> Future:
        """The compile on the compile thread; the same future for the same spec."""
        with self._lock:
            future = self._futures.get(params.key)
            if future is None or (future.done() and future.exception() is not None):
                future = self._pool.submit(self.compile, params)
                self._futures[params.key] = future
                while len(self._futures) > MAX_CACHED_SPECS:  # the oldest spec goes first
                    del self._futures[next(iter(self._futures))]
            return future

    def check(self, params: StructuredOutputsParams, timeout_s: float | None = None):
        """compile, waiting at most the timeout: for callers that must refuse a bad spec
        before anything runs (the router, LLM.generate)."""
        timeout_s = self.compile_timeout_s if timeout_s is None else timeout_s
        try:
            return self.submit(params).result(timeout=timeout_s)
        except FutureTimeout:
            raise InvalidRequestError(f"structured_outputs.{params.kind}",
                                      f"did not compile within {timeout_s:g} s") from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _reason(error: Exception) -> str:
    """xgrammar's message without its C++ source location prefix."""
    text = str(error).strip()
    if text.startswith("[") and ": " in text:
        text = text.split(": ", 1)[1]
        if text.startswith("/") and ": " in text:
            text = text.split(": ", 1)[1]
    return text.splitlines()[0] if text else type(error).__name__


class GrammarState:
    """One request's position in its grammar."""

    def __init__(self, compiled):
        import xgrammar as xgr
        self._matcher = xgr.GrammarMatcher(compiled)  # rollback is unbounded in xgrammar >= 0.1.2x

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advances past the token; False (and no change) when the grammar forbids it."""
        return self._matcher.accept_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        """Undoes the last accepted tokens (speculative drafts that were rejected)."""
        self._matcher.rollback(num_tokens)

    @property
    def terminated(self) -> bool:
        """The grammar accepted a stop token: nothing may follow."""
        return self._matcher.is_terminated()


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    import xgrammar as xgr
    return xgr.allocate_token_bitmask(rows, vocab_size)


def apply_grammar_bitmask(logits: torch.Tensor, grammar_bitmask, row_keys: list[tuple[str, int]]) -> None:
    """Sets to -inf, in place, the logits of the tokens each guided request's grammar
    forbids: logits row i is the row_keys[i] = (req_id, j)-th scored row of its request;
    grammar_bitmask (a bitmask.GrammarBitmask) has rows for the guided requests. The
    padding rows of the vocabulary are always forbidden (the bitmask covers the model's
    whole vocabulary)."""
    import xgrammar as xgr
    rows = grammar_bitmask.rows
    indices = [i for i, (req_id, _) in enumerate(row_keys) if req_id in rows]
    if not indices:
        return
    # xgrammar's kernel reads bitmask row i for logits row i: scatter ours into place
    full = torch.full((logits.shape[0], grammar_bitmask.bitmask.shape[1]), -1, dtype=torch.int32)
    full[indices] = grammar_bitmask.bitmask[[rows[row_keys[i][0]][row_keys[i][1]] for i in indices]]
    xgr.apply_token_bitmask_inplace(logits, full.to(logits.device), vocab_size=logits.shape[-1], indices=indices)