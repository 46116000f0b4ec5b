"""A real Mooncake Store on loopback for tests and benchmarks: `mooncake_master` and store nodes
(`mooncake_client` processes), started as `pdserve up` starts them (cli/mooncake_procs.py)
on free ports, each killable by PID."""
from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

from pdserve.cli.bench.local_platform import free_port_range
from pdserve.cli.mooncake_procs import MooncakePlan
from pdserve.services.kvstore.transports.mooncake.plane import DEFAULT_FAILOVER_S, MooncakeSettings

QUIET = dict(os.environ, GLOG_minloglevel="2")


def wait_accepting(address: str, timeout_s: float = 20.0) -> None:
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=0.2).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing accepts on {address} after {timeout_s} s") from None
            time.sleep(0.05)


class MooncakeCluster:
    def __init__(self, log_dir: Path, replicas: int = 1, segment_bytes: int = 64 << 20):
        self.plan = MooncakePlan(base_port=free_port_range(MooncakePlan(replicas=replicas).num_ports),
                                 replicas=replicas)
        self.segment_bytes = segment_bytes
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen] = {}
        self._argv = {name: (argv, address) for name, argv, address, _, _ in
                      self.plan.processes("127.0.0.1", segment_bytes)}
        self.settings = MooncakeSettings(f"127.0.0.1:{self.plan.master_port}",
                                         f"http://127.0.0.1:{self.plan.metadata_port}/metadata", replicas,
                                         failover_s=DEFAULT_FAILOVER_S if replicas > 1 else 0.0,
                                         store_nodes=tuple(self.plan.store_node("127.0.0.1", i)
                                                           for i in range(replicas)))

    def start(self, name: str) -> None:
        argv, address = self._argv[name]
        log = open(self.log_dir / f"{name}.log", "ab")
        env = {**QUIET, **MooncakePlan.NODE_ENV} if name.startswith("store-") else QUIET
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        wait_accepting(address)

    def start_all(self) -> MooncakeCluster:
        for name in self._argv:  # the master first: the nodes register with it
            self.start(name)
        time.sleep(0.5)  # the nodes' segments mounted (they accept a little before)
        return self

    def touch_segments(self, fill: float = 0.95, object_bytes: int = 4 << 20) -> float:
        """Writes the store nodes' segments once over (objects of zeros, then removed), so
        their pages are mapped: a node that has served a while has done so, and its first
        write into each page costs a page fault (about 5 us a 4 KiB page here, more than
        moving the bytes). Returns the seconds it took."""
        import numpy as np

        from pdserve.services.kvstore.transports.mooncake.plane import connect, replicate_config
        start = time.monotonic()
        plane = connect(self.settings)
        try:
            source = np.zeros(object_bytes, dtype=np.uint8)
            plane.register_buffer(source.ctypes.data, object_bytes)
            count = int(fill * self.segment_bytes) // object_bytes  # each node holds a replica of each
            keys = [f"touch/{os.getpid()}/{i}" for i in range(count)]
            for first in range(0, count, 16):
                chunk = keys[first:first + 16]
                plane.batch_put_from(chunk, [source.ctypes.data] * len(chunk), [object_bytes] * len(chunk),
                                     replicate_config(self.settings))
            plane.batch_remove(keys, True)
            plane.unregister_buffer(source.ctypes.data)
        finally:
            plane.close()
        return time.monotonic() - start

    def kill(self, name: str) -> None:
        proc = self.procs.pop(name)
        proc.kill()
        proc.wait()

    def stop(self) -> None:
        for name in reversed(list(self.procs)):
            self.kill(name)
