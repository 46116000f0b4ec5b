"""The finished requests' writer: what it skips, its byte bound, evictions and failures,
against a fake engine loop and kvstore (the real cluster: tests/services/test_finished_kv_e2e.py)."""
from __future__ import annotations

import argparse
import threading
from concurrent.futures import Future

import grpc
import pytest
import torch

from pdserve.engine.core.block_hash import hash_full_blocks
from pdserve.engine.kv_transfer import KVLayout, KVPayload
from pdserve.services.kvstore.errors import KVStoreFullError
from pdserve.services.worker.config import WorkerConfig, add_worker_arguments, worker_config_from_args
from pdserve.services.worker.finished_kv import (ByteBudget, FinishedKVWriter, FinishedRequest, NoFinishedKVWriter,
                                                 finished_kv_writer, num_blocks_with_kv)
from pdserve.services.worker.kv_integrity import refusal
from pdserve.services.worker.metrics import WorkerMetrics

LAYOUT = KVLayout.of("m", "float32", (2, 2, 4, 1, 2))  # block_size 4, 128 bytes a block
BS, NBYTES = LAYOUT.block_size, LAYOUT.block_nbytes
TOKENS = list(range(100, 125))  # 25 tokens: 6 full blocks with KV (the last token has none)


class FakeInfo:
    kv_layout = LAYOUT
    block_size = BS

    @staticmethod
    def prompt_block_hashes(token_ids, cache_salt=""):
        return hash_full_blocks(LAYOUT.fingerprint, token_ids, BS, cache_salt=cache_salt)


class FakeEngine:
    """Holds the blocks of `held` hashes; exports the leading run it holds, as the engine."""

    def __init__(self, held):
        self.held = {h: torch.full((1, *LAYOUT.block_shape), float(i)) for i, h in enumerate(held)}
        self.asked: list[list[bytes]] = []
        self.gate = threading.Event()
        self.gate.set()

    def export_cached_blocks(self, block_hashes):
        self.gate.wait(10)
        self.asked.append(list(block_hashes))
        run = []
        for h in block_hashes:
            if h not in self.held:
                break
            run.append(h)
        if not run:
            return None
        return KVPayload(len(run) * BS, torch.cat([self.held[h] for h in run]), run)


class FakeLoop:
    info = FakeInfo()

    def __init__(self, engine: FakeEngine):
        self.engine = engine

    def call(self, fn) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(self.engine))
        except Exception as e:  # noqa: BLE001
            future.set_exception(e)
        return future


class FakeStore:
    def __init__(self, stored=(), fail_put: Exception | None = None, fail_lookup: Exception | None = None):
        self.stored = set(stored)
        self.puts: list[list[bytes]] = []
        self.lookups = 0
        self.fail_put, self.fail_lookup = fail_put, fail_lookup

    def lookup(self, block_hashes, lease_id=""):
        self.lookups += 1
        if self.fail_lookup:
            raise self.fail_lookup
        n = 0
        while n < len(block_hashes) and block_hashes[n] in self.stored:
            n += 1
        return n

    def put_blocks(self, headers, data, lease_id=""):
        if self.fail_put:
            raise self.fail_put
        view = memoryview(data)
        for i, header in enumerate(headers):  # sealed as a reader checks them
            assert refusal(header, view[i * NBYTES:], LAYOUT, header.block_hash) is None
        assert not lease_id
        self.puts.append([h.block_hash for h in headers])
        self.stored.update(h.block_hash for h in headers)
        return len(headers)


class Unavailable(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE


HASHES = FakeInfo.prompt_block_hashes(TOKENS)[:6]


def _writer(engine, store, max_bytes=1 << 20, batch_bytes=1 << 20):
    metrics = WorkerMetrics("decode")
    return FinishedKVWriter(FakeLoop(engine), store, metrics, max_bytes, batch_bytes), metrics


def _counts(metrics) -> dict:
    skipped = {s.labels["reason"]: s.value for m in metrics.finished_kv_skipped_blocks.collect()
               for s in m.samples if s.name.endswith("_total")}
    return dict(written=metrics.finished_kv_written_blocks._value.get(),
                bytes=metrics.finished_kv_written_bytes._value.get(),
                failed=metrics.finished_kv_failed_blocks._value.get(), **skipped)


def _write(writer, num_in_store=0, tokens=TOKENS):
    writer.submit(FinishedRequest("r", tokens, "", num_in_store))
    writer.close()  # waits for the queued write


@pytest.mark.parametrize("num_tokens, expected", [(0, 0), (1, 0), (4, 0), (5, 1), (8, 1), (9, 2)])
def test_blocks_with_kv_leave_out_the_last_token(num_tokens, expected):
    assert num_blocks_with_kv(num_tokens, 4) == expected


def test_writes_the_blocks_past_what_the_store_holds():
    engine, store = FakeEngine(HASHES), FakeStore(stored=HASHES[:3])
    writer, metrics = _writer(engine, store)
    _write(writer, num_in_store=2)  # it imported two; the lookup finds a third (an earlier turn)
    assert store.puts == [HASHES[3:6]]
    assert engine.asked == [HASHES[3:6]]
    assert _counts(metrics) == dict(written=3, bytes=3 * NBYTES, failed=0, in_store=3)
    assert writer.budget.in_use == 0


def test_what_the_worker_imported_is_not_sent_even_when_the_lookup_misses_it():
    engine, store = FakeEngine(HASHES), FakeStore()
    writer, metrics = _writer(engine, store)
    _write(writer, num_in_store=4)
    assert store.puts == [HASHES[4:6]] and _counts(metrics)["in_store"] == 4


def test_a_request_the_store_holds_whole_costs_no_lookup_or_export():
    engine, store = FakeEngine(HASHES), FakeStore()
    writer, metrics = _writer(engine, store)
    _write(writer, num_in_store=6)
    _write(_writer(engine, store)[0], tokens=TOKENS[:4])  # no full block with KV at all
    assert (store.lookups, engine.asked, store.puts) == (0, [], [])
    assert _counts(metrics) == dict(written=0, bytes=0, failed=0, in_store=6)


def test_the_salt_names_other_blocks():
    salted = FakeInfo.prompt_block_hashes(TOKENS, "tenant")[:6]
    engine, store = FakeEngine(salted), FakeStore()
    writer, _ = _writer(engine, store)
    writer.submit(FinishedRequest("r", TOKENS, "tenant"))
    writer.close()
    assert store.puts == [salted] and not set(salted) & set(HASHES)


def test_batches_of_batch_bytes():
    engine, store = FakeEngine(HASHES), FakeStore()
    writer, metrics = _writer(engine, store, batch_bytes=2 * NBYTES + 1)
    _write(writer)
    assert store.puts == [HASHES[0:2], HASHES[2:4], HASHES[4:6]]
    assert _counts(metrics)["written"] == 6


def test_an_evicted_block_ends_the_run():
    engine, store = FakeEngine(HASHES[:2] + HASHES[3:]), FakeStore()  # block 2 evicted since
    writer, metrics = _writer(engine, store, batch_bytes=2 * NBYTES)
    _write(writer)
    assert store.puts == [HASHES[0:2]]
    assert _counts(metrics) == dict(written=2, bytes=2 * NBYTES, failed=0, evicted=4)


def test_over_the_byte_bound_a_request_is_skipped_whole_and_counted():
    engine, store = FakeEngine(HASHES), FakeStore()
    writer, metrics = _writer(engine, store, max_bytes=10 * NBYTES)
    engine.gate.clear()  # the first write holds its 6 blocks' bytes while the engine is busy
    writer.submit(FinishedRequest("a", TOKENS))
    writer.submit(FinishedRequest("b", TOKENS, num_in_store=1))  # 5 more would not fit
    assert writer.budget.in_use == 6 * NBYTES
    assert _counts(metrics) == dict(written=0, bytes=0, failed=0, in_store=1, queue_full=5)
    writer.submit(FinishedRequest("c", TOKENS[:17]))  # 4 blocks fit beside the 6
    engine.gate.set()
    writer.close()
    assert writer.budget.in_use == 0
    counts = _counts(metrics)
    assert (counts["written"], counts["in_store"], counts["queue_full"]) == (6, 1 + 4, 5)


def test_a_failed_put_is_counted_and_gives_the_bytes_back():
    engine, store = FakeEngine(HASHES), FakeStore(fail_put=KVStoreFullError("full"))
    writer, metrics = _writer(engine, store, batch_bytes=2 * NBYTES)
    _write(writer, num_in_store=1)
    assert _counts(metrics) == dict(written=0, bytes=0, failed=5, in_store=1)
    assert writer.budget.in_use == 0


def test_a_store_that_is_down_fails_the_write_at_the_lookup():
    engine, store = FakeEngine(HASHES), FakeStore(fail_lookup=Unavailable())
    writer, metrics = _writer(engine, store)
    _write(writer)
    assert engine.asked == [] and _counts(metrics)["failed"] == 6


def test_a_dead_engine_fails_the_write():
    class Dead(FakeEngine):
        def export_cached_blocks(self, block_hashes):
            raise RuntimeError("engine dead")
    writer, metrics = _writer(Dead(HASHES), FakeStore())
    _write(writer)
    assert _counts(metrics)["failed"] == 6 and writer.budget.in_use == 0


def test_after_close_nothing_is_queued():
    engine, store = FakeEngine(HASHES), FakeStore()
    writer, metrics = _writer(engine, store)
    writer.close()
    writer.submit(FinishedRequest("late", TOKENS))
    assert store.puts == [] and _counts(metrics)["shutdown"] == 6


def test_budget_refuses_what_does_not_fit():
    budget = ByteBudget(10)
    assert budget.try_take(6) and not budget.try_take(5) and budget.try_take(4)
    budget.give_back(6)
    assert budget.in_use == 4 and budget.try_take(6)


# ---- the flag ----------------------------------------------------------------------------
def _config(*argv: str) -> WorkerConfig:
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser, default_port=0)
    return worker_config_from_args(parser.parse_args(list(argv)))


def test_the_flag_is_on_by_default_and_off_without_prefix_caching():
    assert _config().kv_write_finished
    assert not _config("--no-kv-write-finished").kv_write_finished
    assert not _config("--no-prefix-caching").kv_write_finished
    assert _config("--kv-write-finished-max-bytes", "64MiB").kv_write_finished_max_bytes == 64 << 20


def test_asking_for_it_without_prefix_caching_is_refused():
    with pytest.raises(ValueError, match="--kv-write-finished: needs prefix caching"):
        _config("--kv-write-finished", "--no-prefix-caching")


@pytest.mark.parametrize("size", ["0", "-1", "lots"])
def test_a_bad_bound_is_refused(size):
    with pytest.raises(SystemExit):
        _config("--kv-write-finished-max-bytes", size)


@pytest.mark.parametrize("cfg", [WorkerConfig(kv_write_finished=False),
                                 WorkerConfig(engine=_config("--no-prefix-caching").engine)])
def test_off_is_the_null_writer(cfg):
    assert isinstance(finished_kv_writer(cfg, FakeLoop(FakeEngine([])), FakeStore(), WorkerMetrics("decode")),
                      NoFinishedKVWriter)
