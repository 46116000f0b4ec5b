"""pdserve services as real processes on loopback (as `pdserve up` starts them), for tests
that must cross real sockets."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.cli.bench.local_platform import free_port_range
from pdserve.services.common.grpc_server import is_serving


def free_ports(n: int) -> list[int]:
    """n free ports below the ephemeral range (cli/bench/local_platform.py: processes bind
    them later, when an outgoing connection could have taken a port bind(0) gave)."""
    base = free_port_range(n)
    return list(range(base, base + n))


@dataclass
class Processes:
    log_dir: Path
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def start(self, name: str, args: list[str], env: dict[str, str] | None = None) -> None:
        log = open(self.log_dir / f"{name}.log", "w")
        self.procs[name] = subprocess.Popen([sys.executable, "-m", "pdserve.cli.main", *args], stdout=log,
                                            stderr=subprocess.STDOUT, env=dict(os.environ, **(env or {})),
                                            start_new_session=True)

    def wait_serving(self, name: str, health_address: str, timeout_s: float = 120.0) -> None:
        """Until the process's (plaintext) health port says SERVING."""
        deadline = time.monotonic() + timeout_s
        while not is_serving(health_address, timeout=0.5):
            if self.procs[name].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start:\n{self.log(name)}")
            time.sleep(0.2)

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text()

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
