"""`LocalPools`, the processes behind `pdserve up --autoscale`, over stand-in worker
processes (real processes that serve nothing and exit on SIGTERM after a drain delay):
which worker goes first, what the router's discovery file lists when, and that the
supervisor never restarts a worker that was drained on purpose."""
from __future__ import annotations

import json
import socket
import sys
import time

from pdserve.cli.autoscale import LocalPools
from pdserve.cli.launcher import Platform, ProcessSpec
from pdserve.cli.supervisor import Supervisor

# exits 0 a little after SIGTERM, as a worker does once its drain is done; listens on its
# --port once it handles SIGTERM
WORKER = ("import signal, socket, sys, time\n"
          "signal.signal(signal.SIGTERM, lambda *_: (time.sleep(float(sys.argv[-1])), sys.exit(0)))\n"
          "s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[2]))); s.listen()\n"
          "time.sleep(600)\n")


def spec(name: str, port: int, drain_s: float = 0.2) -> ProcessSpec:
    return ProcessSpec(name, [sys.executable, "-c", WORKER, "--port", str(port), "--metrics-port", str(port + 1),
                              "--drain-timeout-s", "1", str(drain_s)], f"127.0.0.1:{port}", port + 1)


class FakePlatform(Platform):
    """The real Platform's process handling; health is whatever the test says."""

    def __init__(self, specs, serving: set[str]):
        super().__init__(specs, out=open("/dev/null", "w"))
        self.up = serving

    def serving(self, name: str) -> bool:
        return name in self.up

    def start(self, timeout_s: float = 0) -> None:
        for s in self.specs:
            self.procs[s.name] = self._spawn(s)


def listed(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def listening(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=0.2).close()
        return True
    except OSError:
        return False


def until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_grow_then_drain_newest_first_without_a_restart(tmp_path):
    platform = FakePlatform([spec("prefill-0", 41000), spec("decode-0", 41002)], {"prefill-0", "decode-0"})
    platform.start(timeout_s=10)
    path = str(tmp_path / "workers.json")
    try:
        supervisor = Supervisor(platform)
        pools = LocalPools(platform, supervisor, {"prefill": spec("prefill-0", 41000, drain_s=0.5)}, path,
                           "127.0.0.1", stop_grace_s=5.0, available_cpus=[])
        assert listed(path)["prefill"] == ["127.0.0.1:41000"]
        pools.scale("prefill", 3)
        for s in platform.specs:
            until(lambda: listening(s.address))
        assert pools.replicas("prefill") == 3 and len(pools.metrics_urls("prefill")) == 1  # 2 starting
        new = sorted(n for n in platform.procs if n.startswith("prefill-") and n != "prefill-0")
        assert new == ["prefill-1", "prefill-2"]
        ports = {s.address for s in platform.specs}
        assert len(ports) == len(platform.specs)  # each on its own port
        platform.up.add("prefill-2")
        pools.tick()
        prefill_2 = next(s.address for s in platform.specs if s.name == "prefill-2")
        assert listed(path)["prefill"] == ["127.0.0.1:41000", prefill_2]  # listed once it serves
        # down to 2: the one still starting goes first, at once (it never served)
        pools.scale("prefill", 2)
        assert "prefill-1" not in platform.procs and pools.replicas("prefill") == 2
        # down to 1: the newest serving one drains; it stays listed until it has exited
        pools.scale("prefill", 1)
        assert pools.replicas("prefill") == 1
        assert len(listed(path)["prefill"]) == 2
        for _ in range(5):
            supervisor.tick()
        until(lambda: (pools.tick(), "prefill-2" not in platform.procs)[1])
        assert listed(path)["prefill"] == ["127.0.0.1:41000"]
        assert supervisor.num_restarts("prefill-0") == 0 and "prefill-2" not in supervisor._states
    finally:
        platform.stop(grace_s=2)


def test_a_worker_past_its_grace_is_killed(tmp_path):
    platform = FakePlatform([spec("prefill-0", 41010)], {"prefill-0"})
    platform.start(timeout_s=10)
    try:
        pools = LocalPools(platform, Supervisor(platform), {"prefill": spec("prefill-0", 41010, drain_s=60)},
                           str(tmp_path / "w.json"), "127.0.0.1", stop_grace_s=5.0, available_cpus=[])
        pools._grace_s = lambda pool: 0.5  # noqa: SLF001 - a short grace instead of --drain-timeout-s + 10
        pools.scale("prefill", 2)
        name = next(n for n in platform.procs if n != "prefill-0")
        until(lambda: listening(next(s.address for s in platform.specs if s.name == name)))
        platform.up.add(name)
        pools.tick()
        proc = platform.procs[name]
        pools.scale("prefill", 1)
        until(lambda: (pools.tick(), name not in platform.procs)[1])
        assert proc.returncode == -9
    finally:
        platform.stop(grace_s=2)


def test_the_drain_grace_follows_the_workers_drain_timeout(tmp_path):
    platform = FakePlatform([], set())
    pools = LocalPools(platform, Supervisor(platform), {"decode": spec("decode-0", 41020)}, str(tmp_path / "w.json"),
                       "127.0.0.1", stop_grace_s=35.0, available_cpus=[0, 1])
    assert pools._grace_s("decode") == 11.0  # --drain-timeout-s 1, plus 10 s
