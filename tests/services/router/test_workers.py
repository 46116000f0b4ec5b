"""The worker registry: load reports, the router's own in-flight counts, discovery changes."""
from __future__ import annotations

from pdserve.services.pb import common_pb2
from pdserve.services.router.decide.views import QueuedPrefill
from pdserve.services.router.state import workers as workers_module
from pdserve.services.router.state.discovery import DECODE, PREFILL, Discovery
from pdserve.services.router.state.workers import WorkerRegistry


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


def test_a_draining_worker_dropped_by_discovery_keeps_its_streams_until_it_stops_answering():
    """A Kubernetes scale-down: the pod leaves its EndpointSlice and, on SIGTERM, answers
    NOT_SERVING; its open stream keeps the channel (found by the chart's pods under podman,
    where the stream broke mid-way). Once polls get no answer it goes (its streams migrate)."""
    discovery = _Changing()
    discovery.pools[DECODE] = ("127.0.0.1:2",)
    registry = WorkerRegistry(discovery)
    try:
        registry.report(DECODE, "127.0.0.1:2", common_pb2.WorkerLoad(max_num_seqs=8))
        stub = registry.stub(DECODE, "127.0.0.1:2")
        registry.reserve(DECODE, "127.0.0.1:2", tokens=10)
        discovery.pools[DECODE] = ()
        registry.report(DECODE, "127.0.0.1:2", common_pb2.WorkerLoad(max_num_seqs=8, draining=True), serving=False)
        registry.sync()
        assert registry.stub(DECODE, "127.0.0.1:2") is stub
        assert _view(registry, DECODE, "127.0.0.1:2").draining
        registry.report(DECODE, "127.0.0.1:2", None)   # gone without finishing
        registry.sync()
        assert registry.views(DECODE) == []
    finally:
        registry.close()


def test_a_worker_dropped_by_discovery_with_open_requests_finishes_them_first():
    """A terminating pod leaves its EndpointSlice at once; the streams this router has on it
    keep their channel and finish, the worker takes no new work, and it goes when they end."""
    discovery = _Changing()
    discovery.pools[DECODE] = ("127.0.0.1:2", "127.0.0.1:3")
    registry = WorkerRegistry(discovery)
    try:
        for address in discovery.pools[DECODE]:
            registry.report(DECODE, address, common_pb2.WorkerLoad(max_num_seqs=8))
        stub = registry.stub(DECODE, "127.0.0.1:2")
        release = registry.reserve(DECODE, "127.0.0.1:2", tokens=10)
        discovery.pools[DECODE] = ("127.0.0.1:3",)
        registry.sync()
        leaving = _view(registry, DECODE, "127.0.0.1:2")
        assert leaving.draining and leaving.in_flight == 1  # policy.py: a draining worker is never chosen
        assert registry.stub(DECODE, "127.0.0.1:2") is stub  # the open stream's channel stays
        registry.report(DECODE, "127.0.0.1:2", common_pb2.WorkerLoad(max_num_seqs=8, draining=False))
        assert _view(registry, DECODE, "127.0.0.1:2").draining  # its own SERVING answer does not bring it back
        release()
        registry.sync()
        assert [v.address for v in registry.views(DECODE)] == ["127.0.0.1:3"]
        # one that comes back to discovery while still leaving is a full member again
        discovery.pools[DECODE] = ("127.0.0.1:3", "127.0.0.1:4")
        registry.report(DECODE, "127.0.0.1:3", common_pb2.WorkerLoad(max_num_seqs=8))
        registry.reserve(DECODE, "127.0.0.1:3", tokens=1)
        discovery.pools[DECODE] = ("127.0.0.1:4",)
        registry.sync()
        assert _view(registry, DECODE, "127.0.0.1:3").draining
        discovery.pools[DECODE] = ("127.0.0.1:3", "127.0.0.1:4")
        registry.sync()
        registry.report(DECODE, "127.0.0.1:3", common_pb2.WorkerLoad(max_num_seqs=8))
        assert not _view(registry, DECODE, "127.0.0.1:3").draining
    finally:
        registry.close()


def test_a_report_carries_the_ranked_queue_and_resets_what_was_unreported():
    registry = WorkerRegistry(_Changing())
    try:
        release = registry.reserve(PREFILL, "127.0.0.1:1", tokens=300)
        assert _view(registry, PREFILL, "127.0.0.1:1").unreported_tokens == 300
        load = common_pb2.WorkerLoad(num_queued_prefill_tokens=310, max_step_ms=250, queued_prefill=[
            common_pb2.QueuedPrefill(priority=0, min_rank_tokens=0, max_rank_tokens=16, num_requests=1, num_tokens=10),
            common_pb2.QueuedPrefill(priority=0, min_rank_tokens=256, max_rank_tokens=512, num_requests=1,
                                     num_tokens=300)])
        registry.report(PREFILL, "127.0.0.1:1", load)
        v = _view(registry, PREFILL, "127.0.0.1:1")
        assert v.queued_prefill == (QueuedPrefill(0, 0, 16, 1, 10), QueuedPrefill(0, 256, 512, 1, 300))
        assert (v.max_step_ms, v.unreported_tokens, v.in_flight_tokens) == (250, 0, 300)
        registry.reserve(PREFILL, "127.0.0.1:1", tokens=20)
        release()  # one the report holds ends: the unreported one stays until the next report
        v = _view(registry, PREFILL, "127.0.0.1:1")
        assert (v.unreported_tokens, v.in_flight_tokens) == (20, 20)
    finally:
        registry.close()


def test_a_worker_of_both_roles_is_in_both_pools_and_goes_down_in_both():
    discovery = _Changing()
    discovery.pools = {PREFILL: ("127.0.0.1:1", "127.0.0.1:5"), DECODE: ("127.0.0.1:2", "127.0.0.1:5")}
    registry = WorkerRegistry(discovery)
    try:
        for pool in (PREFILL, DECODE):
            registry.report(pool, "127.0.0.1:5", common_pb2.WorkerLoad(max_num_seqs=4))
        # one engine: a prefill this router sent it weighs on its decode view too (and back)
        release = registry.reserve(PREFILL, "127.0.0.1:5", tokens=300)
        registry.reserve(DECODE, "127.0.0.1:5", tokens=20)
        for pool in (PREFILL, DECODE):
            v = _view(registry, pool, "127.0.0.1:5")
            assert (v.in_flight, v.in_flight_tokens, v.unreported_tokens) == (2, 320, 320)
        release()
        assert _view(registry, DECODE, "127.0.0.1:5").in_flight_tokens == 20
        assert _view(registry, DECODE, "127.0.0.1:2").in_flight == 0  # a worker of one role: its own only
        registry.mark_down(DECODE, "127.0.0.1:5")  # its decode call failed: the process is gone
        assert not _view(registry, PREFILL, "127.0.0.1:5").up and not _view(registry, DECODE, "127.0.0.1:5").up
    finally:
        registry.close()
