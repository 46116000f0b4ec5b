"""A `pdserve up` platform for a benchmark run: the same processes, each worker pinned to
its own cores, on free loopback ports, logs to a file, started and stopped by the caller.

    with local_platform(PlatformConfig(num_prefill=0, num_decode=2),
                        log_path="/tmp/colocated.log") as p:
        run_bench(BenchConfig(target=TargetConfig("grpc", p.router_address), ...))
"""
from __future__ import annotations

import contextlib
import os
import random
import socket
import threading
from dataclasses import replace

from pdserve.cli.launcher import ROUTER, Platform, PlatformConfig, plan


def _ephemeral_start(default: int = 32768) -> int:
    """The first port the kernel hands to outgoing connections (and to bind(0))."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return default


# Ports this process has handed out: a port is free when picked but is bound only later,
# by a process started afterwards, so two picks in a row (a platform's router, then its
# workers) could hand out the same port. CI saw a worker fail to bind for that.
_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()


def free_port_range(n: int, rng: random.Random | None = None, attempts: int = 200) -> int:
    """The first of `n` consecutive loopback ports that are free now and that this process
    has not handed out before, below the kernel's ephemeral range where it leaves room: a
    port picked there can be taken by any outgoing connection between the pick and the bind
    of the process it is meant for (seen: a platform's worker failing to bind during a full
    test run). Mooncake's transfer engine listens in 15000-17000, below this."""
    rng = rng or random.Random()
    top = _ephemeral_start()
    top = top if top - n > 20000 + 1000 else 60000
    with _handed_out_lock:
        for _ in range(attempts):
            base = rng.randrange(20000, top - n)
            ports = range(base, base + n)
            if _handed_out.intersection(ports):
                continue
            if _all_bindable(ports):
                _handed_out.update(ports)
                return base
    raise RuntimeError(f"no {n} consecutive free loopback ports")


def _all_bindable(ports: range) -> bool:
    socks = []
    try:
        for port in ports:
            s = socket.socket()
            socks.append(s)
            s.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    """One loopback port that is free now (free_port_range's rule): for a process started
    afterwards, where binding port 0 would pick from the ephemeral range."""
    return free_port_range(1)


def with_free_ports(cfg: PlatformConfig, http: bool = False) -> PlatformConfig:
    """`cfg` with its gRPC and metrics ports moved to free ranges; the HTTP API on a free
    port when `http`, else none."""
    rng = random.Random()
    num_workers = cfg.num_workers
    grpc_base = free_port_range(num_workers + 3, rng)
    metrics_base = free_port_range(num_workers + 2, rng)
    return replace(cfg, host="127.0.0.1", router_port=grpc_base, kvstore_port=grpc_base + 1,
                   worker_base_port=grpc_base + 2, metrics_base_port=metrics_base,
                   http_port=grpc_base + 2 + num_workers if http else None)


class RunningPlatform:
    def __init__(self, platform: Platform, cfg: PlatformConfig):
        self.platform = platform
        self.cfg = cfg

    @property
    def router_address(self) -> str:
        return f"{self.cfg.host}:{self.cfg.router_port}"

    def worker_metrics(self) -> tuple[str, ...]:
        """The workers' /metrics URLs (BenchConfig.worker_metrics)."""
        return tuple(f"http://{self.cfg.host}:{s.metrics_port}/metrics" for s in self.platform.specs
                     if s.name.startswith(("prefill-", "decode-", "both-")))

    def router_metrics(self) -> str:
        """The router's /metrics URL."""
        spec = next(s for s in self.platform.specs if s.name == ROUTER)
        return f"http://{self.cfg.host}:{spec.metrics_port}/metrics"

    def cpus(self) -> dict[str, list[int]]:
        return {s.name: s.cpus for s in self.platform.specs}

    def warm_up(self) -> None:
        """A few short prompts and one just over the direct-path threshold, so measured
        runs pay no first-call costs on either path."""
        from pdserve.cli.bench.datasets import DatasetConfig, LengthDist
        from pdserve.cli.bench.main import BenchConfig, run_bench
        from pdserve.cli.bench.targets import TargetConfig
        for n, length in ((4, 32), (1, self.cfg.short_prompt_tokens + 16)):
            result = run_bench(BenchConfig(target=TargetConfig("grpc", self.router_address, timeout_s=600),
                                           dataset=DatasetConfig("random", num_requests=n, input_len=LengthDist(length),
                                                                 output_len=LengthDist(4), seed=12345),
                                           progress=False), quiet=True)
            if result.summary["failed"]:
                raise RuntimeError(f"warm-up failed: {result.summary['errors']}")


@contextlib.contextmanager
def local_platform(cfg: PlatformConfig, log_path: str, cpus: list[int] | None = None, http: bool = False):
    """Start the platform (workers split over `cpus`, default this process's), wait until
    every process serves, yield a RunningPlatform, stop every process on the way out.
    `http`: also serve the OpenAI API (RunningPlatform.cfg.http_port)."""
    cfg = with_free_ports(cfg, http)
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    with open(log_path, "w") as log:
        platform = Platform(plan(cfg, cpus or sorted(os.sched_getaffinity(0))), out=log)
        try:
            platform.start(cfg.startup_timeout_s)
            yield RunningPlatform(platform, cfg)
        finally:
            platform.stop()
