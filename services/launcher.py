"""`pdserve up`: the whole platform as local processes on loopback.

kvstore, N prefill workers, M decode workers and the router, each a `pdserve <role>`
process. Like a cluster giving each pod its own GPU, each worker gets its own CPU cores
(affinity and torch threads). Logs are streamed with a per-process prefix; Ctrl-C, or
any process dying, stops them all.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from services.common.grpc_server import is_serving


@dataclass(frozen=True)
class PlatformConfig:
    model: str = "smollm2"
    num_prefill: int = 1
    num_decode: int = 1
    host: str = "127.0.0.1"
    router_port: int = 50051
    http_port: int | None = 8000  # the OpenAI-compatible API; None: off
    kvstore_port: int = 50060
    worker_base_port: int = 50070
    metrics_base_port: int = 9400
    cpus_per_worker: int | None = None
    short_prompt_tokens: int = 256
    worker_args: tuple[str, ...] = ()
    startup_timeout_s: float = 300.0


@dataclass
class ProcessSpec:
    name: str
    argv: list[str]
    address: str
    metrics_port: int
    cpus: list[int] = field(default_factory=list)


def split_cpus(available: list[int], num_workers: int, per_worker: int | None) -> list[list[int]]:
    """Cores for each worker: an even split by default, `per_worker` each when given
    (wrapping around when the machine has fewer cores than asked for)."""
    if num_workers == 0:
        return []
    if per_worker is None:
        per_worker = max(1, len(available) // num_workers)
    return [[available[(w * per_worker + i) % len(available)] for i in range(per_worker)]
            for w in range(num_workers)]


def plan(cfg: PlatformConfig, available_cpus: list[int]) -> list[ProcessSpec]:
    cli = [sys.executable, "-m", "services.cli"]
    kvstore = f"{cfg.host}:{cfg.kvstore_port}"
    specs = [ProcessSpec("kvstore", [*cli, "kvstore", "--host", cfg.host, "--port", str(cfg.kvstore_port),
                                     "--metrics-port", str(cfg.metrics_base_port)], kvstore, cfg.metrics_base_port)]
    roles = ["prefill"] * cfg.num_prefill + ["decode"] * cfg.num_decode
    cpu_sets = split_cpus(available_cpus, len(roles), cfg.cpus_per_worker)
    addresses: dict[str, list[str]] = {"prefill": [], "decode": []}
    for i, (role, cpus) in enumerate(zip(roles, cpu_sets)):
        port, metrics_port = cfg.worker_base_port + i, cfg.metrics_base_port + 1 + i
        name = f"{role}-{len(addresses[role])}"
        addresses[role].append(f"{cfg.host}:{port}")
        specs.append(ProcessSpec(name, [*cli, role, "--model", cfg.model, "--host", cfg.host, "--port", str(port),
                                        "--metrics-port", str(metrics_port), "--kvstore", kvstore,
                                        "--threads", str(len(cpus)), *cfg.worker_args],
                                 f"{cfg.host}:{port}", metrics_port, cpus))
    router_metrics = cfg.metrics_base_port + 1 + len(roles)
    router = [*cli, "router", "--model", cfg.model, "--host", cfg.host, "--port", str(cfg.router_port),
              "--metrics-port", str(router_metrics), "--kvstore", kvstore,
              "--short-prompt-tokens", str(cfg.short_prompt_tokens),
              "--decode", ",".join(addresses["decode"])]
    if addresses["prefill"]:  # none: colocated, the decode workers prefill every prompt
        router += ["--prefill", ",".join(addresses["prefill"])]
    router += ["--http-port", "off" if cfg.http_port is None else str(cfg.http_port)]
    specs.append(ProcessSpec("router", router, f"{cfg.host}:{cfg.router_port}", router_metrics))
    return specs


class Platform:
    def __init__(self, specs: list[ProcessSpec], out=sys.stdout):
        self.specs = specs
        self.out = out
        self.procs: dict[str, subprocess.Popen] = {}
        self._print_lock = threading.Lock()

    def start(self) -> None:
        for spec in self.specs:
            self.procs[spec.name] = self._spawn(spec)

    def _spawn(self, spec: ProcessSpec) -> subprocess.Popen:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if spec.cpus:
            env["OMP_NUM_THREADS"] = str(len(spec.cpus))
        cpus = spec.cpus
        proc = subprocess.Popen(spec.argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
        threading.Thread(target=self._pump, args=(spec.name, proc), daemon=True).start()
        return proc

    def _pump(self, name: str, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            with self._print_lock:
                print(f"[{name:>9}] {line}", end="", file=self.out, flush=True)

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pending = {s.name: s.address for s in self.specs}
        while True:
            dead = self.dead()
            if dead:
                raise RuntimeError(f"{dead} exited during startup (code {self.procs[dead].returncode})")
            pending = {n: a for n, a in pending.items() if not is_serving(a, timeout=0.5)}
            if not pending and self._router_sees_all_workers():
                return
            if time.monotonic() > deadline:
                waiting_for = ", ".join(sorted(pending)) or "the router's polls of every worker"
                raise TimeoutError(f"not healthy after {timeout_s:.0f} s: {waiting_for}")
            time.sleep(0.2)

    def _router_sees_all_workers(self) -> bool:
        """Serving is not enough: a request sent before the router's next poll of a worker
        that came up after the router would find the pool empty."""
        router = next((s for s in self.specs if s.name == "router"), None)
        if router is None:
            return True
        expected = Counter(s.name.split("-")[0] for s in self.specs if s.name.startswith(("prefill-", "decode-")))
        host = router.address.rsplit(":", 1)[0]
        try:
            body = urllib.request.urlopen(f"http://{host}:{router.metrics_port}/metrics", timeout=1).read().decode()
        except OSError:
            return False
        up = {sample.labels["pool"]: sample.value for family in text_string_to_metric_families(body)
              if family.name == "pdserve_router_workers_up" for sample in family.samples}
        return all(up.get(pool, 0) >= n for pool, n in expected.items())

    def dead(self) -> str | None:
        return next((n for n, p in self.procs.items() if p.poll() is not None), None)

    def stop(self, grace_s: float = 10.0) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def run_platform(cfg: PlatformConfig) -> int:
    platform = Platform(plan(cfg, sorted(os.sched_getaffinity(0))))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    platform.start()
    try:
        platform.wait_healthy(cfg.startup_timeout_s)
        _print_endpoints(platform.specs, cfg)
        while not stop.is_set():
            dead = platform.dead()
            if dead:
                print(f"pdserve up: {dead} exited (code {platform.procs[dead].returncode}); stopping all",
                      file=sys.stderr)
                return 1
            stop.wait(0.5)
        return 0
    except (RuntimeError, TimeoutError) as e:
        print(f"pdserve up: error: {e}", file=sys.stderr)
        return 1
    finally:
        platform.stop()


def _print_endpoints(specs: list[ProcessSpec], cfg: PlatformConfig) -> None:
    lines = ["pdserve is up:"]
    for s in specs:
        cpus = f"  cpus {s.cpus}" if s.cpus else ""
        lines.append(f"  {s.name:<10} grpc {s.address:<18} metrics http://{cfg.host}:{s.metrics_port}/metrics{cpus}")
    if cfg.http_port is not None:
        lines.append(f"  OpenAI API  http://{cfg.host}:{cfg.http_port}/v1")
    lines.append(f"try: pdserve generate --url {cfg.host}:{cfg.router_port} --prompt 'Hello'   (Ctrl-C stops all)")
    print("\n".join(lines), flush=True)
