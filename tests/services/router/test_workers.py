"""The worker registry: load reports, the router's own in-flight counts, discovery changes."""
from __future__ import annotations

from services.pb import common_pb2
from services.router import workers as workers_module
from services.router.discovery import DECODE, PREFILL, Discovery
from services.router.workers import WorkerRegistry


class _Changing(Discovery):
    def __init__(self) -> None:
        self.pools = {PREFILL: ("127.0.0.1:1",), DECODE: ("127.0.0.1:2",)}

    def addresses(self, pool):
        return self.pools[pool]


def _view(registry, pool, address):
    return {v.address: v for v in registry.views(pool)}[address]


def test_in_flight_counts_survive_load_reports_and_release_once():
    changes = []
    registry = WorkerRegistry(_Changing(), on_change=changes.append)
    try:
        assert not _view(registry, PREFILL, "127.0.0.1:1").up  # unknown until it answers a poll
        release = registry.reserve(PREFILL, "127.0.0.1:1", tokens=300)
        assert changes == []  # reserving never wakes anyone
        registry.report(PREFILL, "127.0.0.1:1", common_pb2.WorkerLoad(num_queued_prefill_tokens=50, max_num_seqs=4))
        v = _view(registry, PREFILL, "127.0.0.1:1")
        assert (v.up, v.num_queued_prefill_tokens, v.max_num_seqs, v.in_flight, v.in_flight_tokens) == (True, 50, 4, 1, 300)
        release()
        release()
        v = _view(registry, PREFILL, "127.0.0.1:1")
        assert (v.in_flight, v.in_flight_tokens) == (0, 0)
        registry.mark_down(PREFILL, "127.0.0.1:1")
        assert not _view(registry, PREFILL, "127.0.0.1:1").up
        assert changes == [PREFILL, PREFILL, PREFILL]  # the report, the release, the mark
        registry.report(PREFILL, "127.0.0.1:1", None)
        assert not _view(registry, PREFILL, "127.0.0.1:1").up
    finally:
        registry.close()


def test_discovery_changes_add_and_remove_workers_keeping_channels(monkeypatch):
    opened = []
    real = workers_module._Worker
    monkeypatch.setattr(workers_module, "_Worker",
                        lambda pool, address, *rest: opened.append(address) or real(pool, address, *rest))
    discovery = _Changing()
    registry = WorkerRegistry(discovery)
    try:
        stub = registry.stub(DECODE, "127.0.0.1:2")
        discovery.pools[DECODE] = ("127.0.0.1:2", "127.0.0.1:3")
        registry.sync()
        registry.sync()
        assert [v.address for v in registry.views(DECODE)] == ["127.0.0.1:2", "127.0.0.1:3"]
        assert registry.stub(DECODE, "127.0.0.1:2") is stub
        assert opened == ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]  # one channel each, never reopened
        discovery.pools[DECODE] = ("127.0.0.1:3",)
        registry.sync()
        assert [v.address for v in registry.views(DECODE)] == ["127.0.0.1:3"]
        registry.mark_down(DECODE, "127.0.0.1:2")  # a late report for a removed worker: ignored
    finally:
        registry.close()
