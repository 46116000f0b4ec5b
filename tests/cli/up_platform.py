"""A `pdserve up` started by a test: its output collected line by line, its processes
stopped and checked gone at the end (rank processes included: one session holds all)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from pdserve.cli.bench.local_platform import free_port_range


class Platform:
    """A running `pdserve up`, its output collected line by line."""

    def __init__(self, proc: subprocess.Popen, ports: dict[str, int]):
        self.proc, self.ports = proc, ports
        self.lines: list[str] = []
        self._cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line)
                self._cond.notify_all()

    def wait_for(self, pattern: str, timeout_s: float, start: int = 0) -> re.Match:
        """The first line from `start` on that matches `pattern`."""
        deadline = time.monotonic() + timeout_s
        regex = re.compile(pattern)
        with self._cond:
            while True:
                for line in self.lines[start:]:
                    if match := regex.search(line):
                        return match
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    raise AssertionError(f"no line matching {pattern!r}:\n{self.log()}")
                self._cond.wait(min(left, 0.5))

    def mark(self) -> int:
        with self._cond:
            return len(self.lines)

    def log(self) -> str:
        with self._cond:
            return "".join(self.lines[-120:])

    def pid(self, name: str, since: int = 0) -> int:
        """The process's pid: from the startup table, or its latest restart after `since`."""
        restarts = [re.search(rf"restarted {name} \(pid (\d+)", line) for line in self.lines[since:]]
        restarts = [m for m in restarts if m]
        if restarts:
            return int(restarts[-1].group(1))
        return int(self.wait_for(rf"^\s+{name}\s+(?:grpc|tcp) .* pid (\d+)", 1).group(1))

    def metrics_url(self, name: str) -> str:
        """A process's /metrics URL, from the startup table."""
        return self.wait_for(rf"^\s+{name}\s+(?:grpc|tcp) \S+\s+metrics (http://\S+/metrics)", 1).group(1)

    @property
    def router(self) -> str:
        return f"127.0.0.1:{self.ports['router']}"

    def metric(self, role_index: int, name: str, labels: str = "") -> float:
        """A sample from the /metrics of process `role_index` (kvstore 0, prefill 1, decode 2, router 3)."""
        return scrape(f"http://127.0.0.1:{self.ports['metrics'] + role_index}/metrics", name, labels)


def scrape(url: str, name: str, labels: str = "") -> float:
    """One sample of a /metrics page (0 when absent)."""
    text = urllib.request.urlopen(url, timeout=2).read().decode()
    match = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def up_ports(num_workers: int, http: bool = False) -> dict[str, int]:
    ports = {"router": free_port_range(1), "kvstore": free_port_range(1), "workers": free_port_range(num_workers),
             "metrics": free_port_range(num_workers + 2)}
    if http:
        ports["http"] = free_port_range(1)
    return ports


@contextmanager
def running_up(model_dir: str, ports: dict[str, int], extra_args: list[str], log_dir: Path,
               startup_timeout_s: float = 240, pdserve: tuple[str, ...] = (sys.executable, "-m", "pdserve.cli.main"),
               cwd: Path | None = None, env: dict[str, str] | None = None):
    """`pdserve up` on `ports` until the block ends; then SIGINT (a terminal's Ctrl-C), its
    log saved under `log_dir`, and no process of its session left behind. `pdserve`, `cwd`
    and `env`: the command as a user runs it (an installed console script, elsewhere); its
    processes log warnings and worse unless `env` sets PDSERVE_LOG_LEVEL."""
    cmd = [*pdserve, "up", "--model", model_dir,
           "--port", str(ports["router"]), "--kvstore-port", str(ports["kvstore"]),
           "--http-port", str(ports["http"]) if "http" in ports else "off",
           "--worker-base-port", str(ports["workers"]), "--metrics-base-port", str(ports["metrics"]), *extra_args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            cwd=cwd, env={"PDSERVE_LOG_LEVEL": "WARNING", **(env or os.environ)})
    up = Platform(proc, ports)
    try:
        up.wait_for("pdserve is up", timeout_s=startup_timeout_s)
        yield up
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=90)
        finally:
            if proc.poll() is None:
                proc.kill()
            (log_dir / "pdserve-up.log").write_text("".join(up.lines))
    left = subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert left == [], f"processes left behind: {left}"
