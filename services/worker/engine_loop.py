"""Runs an EngineCore on its own thread: RPC threads submit and abort, the loop steps.

The engine is not thread-safe, so every change to it (add, abort, a query) is a command
the loop thread runs between two steps. Each request's outputs go to its own queue; the
RPC thread that submitted it reads them. Steps continue while RPC threads do slow I/O
(fetching KV from the kvstore, writing it back), so no transfer stalls the running batch.
RPC threads read only `info` (immutable) and `stats` (a frozen snapshot, replaced after
each step), never the engine, and never an output the engine will change again: the
engine reuses one RequestOutput per request and overwrites its step fields (the new
tokens and text, the finish state) every step, so a stream gets a copy of each step's.
"""
from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

from pdserve.engine import EngineCore, RequestOutput
from pdserve.engine.core.cache_events import KVEvents
from pdserve.engine.engine_request import EngineRequest
from pdserve.engine.errors import EngineDeadError
from pdserve.engine.info import EngineInfo
from pdserve.engine.stats import EngineStats

logger = logging.getLogger(__name__)


class EngineLoop:
    def __init__(self, engine: EngineCore, on_step: Callable[[EngineStats], None] | None = None,
                 on_kv_events: Callable[[KVEvents], None] | None = None):
        """`on_kv_events`: the prefix cache's changes, drained after each step (on this
        loop's thread; the callee hands them to other threads itself)."""
        self._engine = engine
        self.info: EngineInfo = engine.info
        self.stats: EngineStats = engine.stats()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, queue.SimpleQueue] = {}
        self._num_open: dict[str, int] = {}  # completions of a stream not finished (SamplingParams.n)
        self._wakeup = threading.Event()
        self._stopping = False
        self._on_step = on_step
        self._on_kv_events = on_kv_events
        # set when the engine can no longer step (a tensor/pipeline rank died): the worker exits
        self.dead = threading.Event()
        self.dead_reason = ""
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._wakeup.set()
        self._thread.join(timeout=30)

    def shutdown_engine(self) -> None:
        """After stop(): the engine's rank processes (tensor/pipeline parallelism) end too."""
        self._engine.shutdown()

    def call(self, fn: Callable[[EngineCore], object]) -> Future:
        """Run fn(engine) on the loop thread; the future holds its result or exception."""
        future: Future = Future()
        if self.dead.is_set():
            future.set_exception(EngineDeadError(self.dead_reason))
            return future
        self._commands.put((fn, future))
        self._wakeup.set()
        return future

    def num_local_prefix_blocks(self, block_hashes: list[bytes]) -> int:
        """How many leading blocks of `block_hashes` the prefix cache holds (the device's,
        then the host tier's), read from the calling thread (lookups only, each atomic under
        the GIL: dict and OrderedDict membership). A hint: the loop may add
        or evict blocks right after, and the engine takes what it finds at admission. Not
        through call(): that waits for a step boundary, and a submit() right after it then
        misses the step that boundary starts, so on a busy worker the request would wait
        one whole extra step."""
        return self._engine.num_local_prefix_blocks(block_hashes)

    def submit(self, request: EngineRequest) -> queue.SimpleQueue:
        """Queue a request; returns the queue its outputs arrive on (ends with None, after
        the final output of each of its n completions, told apart by `index`).
        Raises the engine's InvalidRequestError."""
        stream: queue.SimpleQueue = queue.SimpleQueue()

        def add(engine: EngineCore) -> None:
            engine.add_request(request)
            self._streams[request.req_id] = stream
            self._num_open[request.req_id] = request.params.n
        self.call(add).result()
        return stream

    def abort(self, req_id: str) -> None:
        self.call(lambda engine: engine.abort_request(req_id))

    # ---- the loop thread -------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping:
            self._run_commands()
            try:
                self._engine.check_health()  # a rank that died while the engine idled
                if not self._engine.has_unfinished_requests():
                    self._wakeup.wait(timeout=0.5)
                    self._wakeup.clear()
                    continue
                outputs = self._engine.step()
            except EngineDeadError as e:
                self._die(str(e))
                return
            except Exception:  # a failed step must not leave RPC threads waiting forever
                logger.exception("engine step failed; aborting its requests")
                self._fail_all()
                continue
            for out in outputs:
                self._deliver(out)
            self.stats = self._engine.stats()
            if self._on_step is not None:
                self._on_step(self.stats)
            if self._on_kv_events is not None:
                self._publish_kv_events()
        self._fail_all()

    def _die(self, reason: str) -> None:
        """Fail every request and every queued command; the worker process then exits."""
        logger.critical("the engine cannot go on: %s", reason)
        self.dead_reason = reason
        self.dead.set()
        self._fail_all()
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                break
            future.set_exception(EngineDeadError(reason))
        self._engine.shutdown()

    def _publish_kv_events(self) -> None:
        events = self._engine.take_kv_events()
        if not events.is_empty:
            self._on_kv_events(events)

    def _run_commands(self) -> None:
        while True:
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                future.set_result(fn(self._engine))
            except Exception as e:  # handed to the caller, who raises it in its own thread
                future.set_exception(e)

    def _deliver(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.req_id)
        if stream is None:
            return
        stream.put(step_output(out))
        if out.finished:
            self._num_open[out.req_id] -= 1
            if not self._num_open[out.req_id]:
                stream.put(None)
                del self._streams[out.req_id], self._num_open[out.req_id]

    def _fail_all(self) -> None:
        for req_id in list(self._streams):
            self._engine.abort_request(req_id)
            self._streams.pop(req_id).put(None)
            self._num_open.pop(req_id, None)


def step_output(out: RequestOutput) -> RequestOutput:
    """This step's output as the engine will not change it. A reader that lags a step
    behind the loop would otherwise read the next step's tokens (a token lost, another
    sent twice) or an earlier step as the last. A finished output is no longer the
    engine's; an unfinished one is copied with this step's logprobs only (its `token_ids`
    stays the engine's growing list: read the step's `new_token_ids`)."""
    if out.finished:
        return out
    logprobs = out.logprobs[len(out.logprobs) - len(out.new_token_ids):] if out.logprobs else out.logprobs
    return dataclasses.replace(out, logprobs=logprobs)
