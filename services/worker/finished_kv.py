"""A decode worker's finished requests, written to the kvstore for their next turn.

Turn 2 of a conversation is turn 1's prompt + answer + a new message. The prefill worker
wrote turn 1's prompt blocks; the answer's KV exists only on the decode worker that
generated it. So when a request finishes normally, its full blocks with KV (prompt and
answer: every token but the last, which was sampled and never fed) are exported from the
engine's prefix cache, where they stay after the request freed them, and written to the
kvstore in the background. Turn 2's prefill then finds its whole history in the store,
whichever workers serve it.

    tokens     [ prompt .............. | answer ............ |last]
    blocks     [b0][b1][b2][b3][b4][b5][b6][b7][b8][b9]              full, every token's KV computed
    in store   [b0][b1][b2][b3]                                      imported from it, or Lookup says so
    written                    [b4][b5][b6][b7][b8][b9]              exported in batches, PutBlocks

- The response was streamed before a request is submitted here; nothing here can delay
  or fail it.
- Bounded: the bytes of the requests queued or being written are at most `max_bytes`;
  a request that does not fit is skipped whole and counted (`queue_full`).
- The export runs on the engine's loop between steps (EngineCore.export_cached_blocks),
  one batch of about BATCH_BYTES at a time, so a long history never holds a step up for
  long; the put goes through the worker's KVStoreClient (gRPC, UCX or Mooncake alike),
  without a lease: the blocks are ordinary LRU entries, pinned by nobody.
- A block the prefix cache evicted before its turn ends the run (`evicted`): the blocks
  after it would be unreadable, since a reader's Lookup counts a leading run.

Every full block with KV of a submitted request is counted once: written, skipped (by
reason) or failed. Blocks already in the store count as skipped `in_store`.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from pdserve.engine.kv_transfer import KVPayload
from pdserve.services.kvstore.client import KVStoreClient
from pdserve.services.worker.config import WorkerConfig
from pdserve.services.worker.engine_loop import EngineLoop
from pdserve.services.worker.kv_seal import KVKeys
from pdserve.services.worker.kv_wire import payload_to_put
from pdserve.services.worker.metrics import WorkerMetrics

logger = logging.getLogger(__name__)

# Bytes exported from the engine and put at once: the size of the UCX transport's batches
# and of GetBlocks' answers (docs/kvstore.md), a few ms of copying on the engine's thread.
BATCH_BYTES = 16 << 20
# On shutdown: how long the writes still queued may take; the rest are skipped. The
# engine's cache is lost with the process, so what is written now is all that is kept.
CLOSE_TIMEOUT_S = 10.0

IN_STORE, QUEUE_FULL, EVICTED, SHUTDOWN = "in_store", "queue_full", "evicted", "shutdown"


@dataclass(frozen=True)
class FinishedRequest:
    """What the writer needs of a request that finished normally (not aborted, no error)."""
    req_id: str
    token_ids: list[int]   # the prompt, then every output token (those given to the worker too)
    cache_salt: str = ""
    num_in_store: int = 0  # leading full blocks the worker knows the store holds (it imported them)


def num_blocks_with_kv(num_tokens: int, block_size: int) -> int:
    """Full blocks whose every token's KV was computed: the last token, sampled and never
    fed to the model, has none."""
    return max(0, num_tokens - 1) // block_size


class ByteBudget:
    """At most `capacity` bytes taken at once (thread-safe); a take that does not fit is
    refused, never waited for."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._in_use = 0
        self._lock = threading.Lock()

    @property
    def in_use(self) -> int:
        return self._in_use

    def try_take(self, num_bytes: int) -> bool:
        with self._lock:
            if self._in_use + num_bytes > self.capacity:
                return False
            self._in_use += num_bytes
            return True

    def give_back(self, num_bytes: int) -> None:
        with self._lock:
            self._in_use -= num_bytes


class NoFinishedKVWriter:
    """--no-kv-write-finished (or no prefix caching to export from): nothing is written."""

    def submit(self, finished: FinishedRequest) -> None:
        pass

    def close(self) -> None:
        pass


class FinishedKVWriter:
    """One background thread writing finished requests' blocks, in the order they finished
    (so completions sharing a prompt write it once: the second's Lookup finds it)."""

    def __init__(self, loop: EngineLoop, kvstore: KVStoreClient, metrics: WorkerMetrics, max_bytes: int,
                 batch_bytes: int = BATCH_BYTES, kv_keys: KVKeys | None = None):
        self._loop, self._kvstore, self._metrics = loop, kvstore, metrics
        self._kv_keys = kv_keys
        self._layout = loop.info.kv_layout
        self._block_size, self._block_nbytes = self._layout.block_size, self._layout.block_nbytes
        self._batch_blocks = max(1, batch_bytes // self._block_nbytes)
        self.budget = ByteBudget(max_bytes)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kv-write-finished")
        self._lock = threading.Lock()
        self._closed = False
        self._deadline = float("inf")  # set by close(): queued writes left after it are skipped

    def submit(self, finished: FinishedRequest) -> None:
        """Queues the write of the request's blocks the store may lack, if their bytes fit."""
        num_blocks = num_blocks_with_kv(len(finished.token_ids), self._block_size)
        num_known = min(finished.num_in_store, num_blocks)
        num_bytes = (num_blocks - num_known) * self._block_nbytes
        if not num_bytes:
            self._skipped(IN_STORE, num_known)
            return
        with self._lock:
            closed = self._closed
            accepted = not closed and self.budget.try_take(num_bytes)
            if accepted:
                self._pool.submit(self._write, finished, num_blocks, num_bytes)
        if not accepted:
            self._skipped(IN_STORE, num_known)
            self._skipped(SHUTDOWN if closed else QUEUE_FULL, num_blocks - num_known)

    def close(self) -> None:
        """Writes what is queued, for up to CLOSE_TIMEOUT_S; before the engine loop and the
        kvstore client stop (the export needs the one, the put the other)."""
        with self._lock:
            self._closed = True
            self._deadline = time.monotonic() + CLOSE_TIMEOUT_S
        self._pool.shutdown(wait=True)

    # ---- the writer thread -----------------------------------------------------------
    def _write(self, finished: FinishedRequest, num_blocks: int, num_bytes: int) -> None:
        try:
            self._write_blocks(finished, num_blocks)
        except Exception:  # a bug; the response is long gone, the next turn recomputes
            logger.exception("writing the finished request %s to the kvstore failed", finished.req_id)
        finally:
            self.budget.give_back(num_bytes)

    def _write_blocks(self, finished: FinishedRequest, num_blocks: int) -> None:
        hashes = self._loop.info.prompt_block_hashes(finished.token_ids, finished.cache_salt)[:num_blocks]
        num_known = min(finished.num_in_store, num_blocks)
        if time.monotonic() > self._deadline:
            self._skipped(IN_STORE, num_known)
            self._skipped(SHUTDOWN, num_blocks - num_known)
            return
        try:  # the store may hold more than the worker knows (an earlier turn, another worker)
            done = max(num_known, self._kvstore.lookup(hashes))
        except grpc.RpcError as e:
            self._failed(finished.req_id, num_blocks - num_known, e)
            self._skipped(IN_STORE, num_known)
            return
        self._skipped(IN_STORE, done)
        while done < num_blocks:
            if time.monotonic() > self._deadline:
                self._skipped(SHUTDOWN, num_blocks - done)
                return
            batch = hashes[done:done + self._batch_blocks]
            try:
                num_written = self._write_batch(batch, finished.cache_salt)
            except Exception as e:  # noqa: BLE001  (counted and logged by _failed)
                self._failed(finished.req_id, num_blocks - done, e)
                return
            done += num_written
            if num_written < len(batch):
                self._skipped(EVICTED, num_blocks - done)
                return

    def _write_batch(self, block_hashes: list[bytes], cache_salt: str) -> int:
        """Exports the leading run of `block_hashes` the engine still holds and puts it;
        returns how many blocks that was."""
        payload: KVPayload | None = self._loop.call(
            lambda engine: engine.export_cached_blocks(block_hashes)).result()
        if payload is None:
            return 0
        headers, data = payload_to_put(payload, self._layout, tail_key="", keys=self._kv_keys, cache_salt=cache_salt,
                                       out=self._kvstore.export_buffer if self._kv_keys else None)
        self._kvstore.put_blocks(headers, data)
        num = len(headers)
        self._metrics.finished_kv_written_blocks.inc(num)
        self._metrics.finished_kv_written_bytes.inc(num * self._block_nbytes)
        return num

    def _skipped(self, reason: str, num_blocks: int) -> None:
        if num_blocks > 0:
            self._metrics.finished_kv_skipped_blocks.labels(reason).inc(num_blocks)

    def _failed(self, req_id: str, num_blocks: int, error: Exception) -> None:
        if isinstance(error, grpc.RpcError):  # KVStoreFullError among them
            logger.warning("kvstore write of the finished request %s failed (%s); its next turn recomputes "
                           "what is missing", req_id, error.code())
        else:
            logger.exception("kvstore write of the finished request %s failed", req_id, exc_info=error)
        self._metrics.finished_kv_failed_blocks.inc(num_blocks)


def finished_kv_writer(cfg: WorkerConfig, loop: EngineLoop, kvstore: KVStoreClient,
                       metrics: WorkerMetrics) -> FinishedKVWriter | NoFinishedKVWriter:
    """The writer, or the null one when off or when the engine keeps no prefix cache (the
    blocks are exported from it)."""
    if not cfg.kv_write_finished or not cfg.engine.cache.enable_prefix_caching:
        return NoFinishedKVWriter()
    return FinishedKVWriter(loop, kvstore, metrics, cfg.kv_write_finished_max_bytes, kv_keys=cfg.kv_keys)
