"""`pdserve up --autoscale`: the chart's HPAs, run locally against worker processes.

The targets, windows and policies come from the chart's values.yaml (merged with any
`--autoscale-values` files, as `helm -f` merges them): the same definition the cluster's
HPAs are rendered from. The controller (autoscale/controller.py) reads each
worker's /metrics and decides; `LocalPools` carries its decisions out:

    scale up:   start `pdserve <pool>` on fresh ports ─▶ SERVING ─▶ listed in the discovery
                file ─▶ the router's next poll adds it to the pool
    scale down: the newest worker leaves supervision ─▶ SIGTERM: it refuses new work
                (health NOT_SERVING, the router stops choosing it; a call that races in
                is retried elsewhere), finishes its prefills / streams within its
                --drain-timeout-s ─▶ exits ─▶ dropped from the discovery file and the platform

The router watches the discovery file (services/router/state/file_discovery.py); a worker stays
listed while it drains, so the router's channel to it, and the streams on it, stay open.
"""
from __future__ import annotations

import copy
import os
import signal
import socket
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml

from pdserve.autoscale.chart_values import CHART_VALUES
from pdserve.autoscale.controller import SYNC_PERIOD_S, Autoscaler, PoolScaler, pools_from_values
from pdserve.services.router.state.file_discovery import write_pools

POOLS = ("prefill", "decode")


@dataclass(frozen=True)
class AutoscaleConfig:
    values: dict = field(repr=False)          # the chart's values, merged with the override files
    discovery_file: str                       # the router's --discovery-file
    sync_period_s: float = SYNC_PERIOD_S


def merge_values(base: dict, override: dict) -> dict:
    """helm's merge of a values file over the chart's: maps merge key by key, the rest replaces."""
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_values(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def load_values(override_paths: list[str] | tuple[str, ...] = ()) -> dict:
    values = yaml.safe_load(CHART_VALUES.read_text())
    for path in override_paths:
        try:
            override = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ValueError(f"--autoscale-values: cannot read {path}: {e}") from None
        if not isinstance(override, dict):
            raise ValueError(f"--autoscale-values: {path} is not a mapping of values")
        values = merge_values(values, override)
    return values


def add_autoscale_arguments(p) -> None:
    p.add_argument("--autoscale", action="store_true",
                   help="scale the prefill and decode pools like the chart's HPAs (TTFT / ITL targets, "
                        "windows and policies from deploy/helm/pdserve/values.yaml)")
    p.add_argument("--autoscale-values", action="append", default=[], metavar="FILE",
                   help="with --autoscale: a values file merged over the chart's, as `helm -f` (repeatable)")
    p.add_argument("--autoscale-sync-s", type=float, default=SYNC_PERIOD_S, metavar="S",
                   help="with --autoscale: seconds between two decisions (the HPA controller's sync period)")


def autoscale_config_from_args(args) -> AutoscaleConfig | None:
    if not args.autoscale:
        if args.autoscale_values:
            raise ValueError("--autoscale-values: needs --autoscale")
        return None
    if not args.autoscale_sync_s > 0:
        raise ValueError(f"--autoscale-sync-s: must be > 0, got {args.autoscale_sync_s}")
    values = load_values(args.autoscale_values)
    pools_from_values(values)  # a bad value stops `pdserve up` before any process starts
    path = os.path.join(tempfile.mkdtemp(prefix="pdserve-autoscale-"), "workers.json")
    return AutoscaleConfig(values, path, args.autoscale_sync_s)


def router_discovery_args(cfg: AutoscaleConfig | None) -> tuple[str, ...]:
    return () if cfg is None else ("--discovery", "file", "--discovery-file", cfg.discovery_file)


def _free_port(host: str, start: int, taken: set[int]) -> int:
    port = start
    while True:
        if port not in taken:
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                    return port
                except OSError:
                    pass
        port += 1


@dataclass
class _Member:
    name: str
    pool: str
    address: str
    metrics_url: str
    state: str            # "starting" | "serving" | "draining"
    since: float = field(default_factory=time.monotonic)


class LocalPools(PoolScaler):
    """The pools of a running Platform, grown and shrunk by process."""

    def __init__(self, platform, supervisor, templates: dict, discovery_file: str, host: str,
                 stop_grace_s: float, available_cpus: list[int], log=print):
        """`templates`: pool -> a ProcessSpec whose argv a new worker copies (ports and cores
        replaced)."""
        self.platform, self.supervisor, self.templates = platform, supervisor, templates
        self.available_cpus = available_cpus
        self._num_started = 0  # workers started so far, the planned ones included (cores round-robin)
        self.discovery_file, self.host, self.stop_grace_s, self._log = discovery_file, host, stop_grace_s, log
        self.members: dict[str, _Member] = {}
        self._next_index = {pool: 0 for pool in POOLS}
        self._drain_deadline: dict[str, float] = {}
        for spec in platform.specs:
            pool = spec.name.split("-")[0]
            if pool in POOLS:
                self.members[spec.name] = _Member(spec.name, pool, spec.address, self._url(spec), "serving")
                self._next_index[pool] = max(self._next_index[pool], int(spec.name.split("-")[1]) + 1)
                self._num_started += 1
        self.write_discovery()

    def _url(self, spec) -> str:
        return f"http://{self.host}:{spec.metrics_port}/metrics"

    # -- PoolScaler ------------------------------------------------------------------------

    def replicas(self, pool: str) -> int:
        return sum(m.pool == pool and m.state != "draining" for m in self.members.values())

    def metrics_urls(self, pool: str) -> list[str]:
        return [m.metrics_url for m in self.members.values() if m.pool == pool and m.state == "serving"]

    def scale(self, pool: str, replicas: int) -> None:
        live = [m for m in self.members.values() if m.pool == pool and m.state != "draining"]
        for _ in range(replicas - len(live)):
            self._add(pool)
        # like a ReplicaSet: pods not ready yet go first, then the newest
        victims = sorted(live, key=lambda m: (m.state == "serving", -m.since))
        for member in victims[:max(0, len(live) - replicas)]:
            self._drain(member)

    # -- the processes ---------------------------------------------------------------------

    def tick(self) -> None:
        """Follow the starting and draining workers (call it every few hundred ms)."""
        changed = False
        for member in list(self.members.values()):
            if member.state == "starting" and self.platform.serving(member.name):
                member.state, changed = "serving", True
                self._log(f"autoscale: {member.name} serving on {member.address} after "
                          f"{time.monotonic() - member.since:.1f} s; added to the router's {member.pool} pool")
            elif member.state == "draining":
                changed |= self._reap(member)
        if changed:
            self.write_discovery()

    def write_discovery(self) -> None:
        listed = {pool: [m.address for m in self.members.values()
                         if m.pool == pool and m.state in ("serving", "draining")] for pool in POOLS}
        write_pools(self.discovery_file, listed)

    def _add(self, pool: str) -> None:
        spec = self._new_spec(pool)
        self.platform.launch(spec)
        self.supervisor.watch(spec.name)
        self.members[spec.name] = _Member(spec.name, pool, spec.address, self._url(spec), "starting")
        self._log(f"autoscale: starting {spec.name} on {spec.address}, metrics {self._url(spec)} "
                  f"(pid {self.platform.procs[spec.name].pid}, cpus {spec.cpus})")

    def _new_spec(self, pool: str):
        template = self.templates[pool]
        taken = {int(s.address.rsplit(":", 1)[1]) for s in self.platform.specs} | {s.metrics_port
                                                                                   for s in self.platform.specs}
        port = _free_port(self.host, max(taken) + 1, taken)
        metrics_port = _free_port(self.host, port + 1, taken | {port})
        argv = _replace_flag(_replace_flag(list(template.argv), "--port", str(port)), "--metrics-port",
                             str(metrics_port))
        name = f"{pool}-{self._next_index[pool]}"
        self._next_index[pool] += 1
        return replace(template, name=name, argv=argv, address=f"{self.host}:{port}", metrics_port=metrics_port,
                       cpus=self._next_cpus(len(template.cpus)), env=dict(template.env))

    def _next_cpus(self, count: int) -> list[int]:
        """As many cores as the template had, taken round-robin: new workers spread over the
        machine rather than all sharing the first worker's cores."""
        if not count or not self.available_cpus:
            return []
        n, start = len(self.available_cpus), self._num_started * count
        self._num_started += 1
        return list(dict.fromkeys(self.available_cpus[(start + i) % n] for i in range(count)))

    def _drain(self, member: _Member) -> None:
        self.supervisor.forget(member.name)  # stopped on purpose: not a crash to restart
        proc = self.platform.procs[member.name]
        if member.state == "starting":  # never served: nothing to drain
            self.members.pop(member.name)
            proc.kill()
            proc.wait()
            self.platform.remove(member.name)
            self._log(f"autoscale: stopped {member.name} before it served")
            return
        member.state, member.since = "draining", time.monotonic()
        self._drain_deadline[member.name] = time.monotonic() + self._grace_s(member.pool)
        proc.send_signal(signal.SIGTERM)
        self._log(f"autoscale: draining {member.name} (pid {proc.pid}): it finishes its work, then exits")

    def _grace_s(self, pool: str) -> float:
        """How long a draining worker may take before it is killed: its own --drain-timeout-s
        plus 10 s (the chart's grace period, less the preStop pause), else the platform's."""
        value = _flag_value(self.templates[pool].argv, "--drain-timeout-s")
        try:
            return float(value) + 10.0 if value is not None else self.stop_grace_s
        except ValueError:
            return self.stop_grace_s

    def _reap(self, member: _Member) -> bool:
        proc = self.platform.procs[member.name]
        if proc.poll() is None:
            if time.monotonic() < self._drain_deadline[member.name]:
                return False
            proc.kill()  # past its grace, as the kubelet would
            proc.wait()
        self.members.pop(member.name)
        self._drain_deadline.pop(member.name)
        self.platform.remove(member.name)
        self._log(f"autoscale: {member.name} drained and exited (code {proc.returncode}) after "
                  f"{time.monotonic() - member.since:.1f} s; removed from the router's {member.pool} pool")
        return True


def _flag_value(argv, flag: str) -> str | None:
    """The last value of `flag` (`--flag v` or `--flag=v`), as argparse reads it."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def _replace_flag(argv: list[str], flag: str, value: str) -> list[str]:
    i = argv.index(flag)
    argv[i + 1] = value
    return argv


def _print(line: str) -> None:
    print(line, flush=True)  # interleaved with the workers' lines, which the launcher flushes


class LocalAutoscaler:
    """What `run_platform` ticks: the controller's decisions and the pools' processes."""

    def __init__(self, cfg: AutoscaleConfig, platform, supervisor, templates: dict, host: str,
                 stop_grace_s: float, available_cpus: list[int]):
        pools = pools_from_values(cfg.values)
        self.pools = LocalPools(platform, supervisor, {p: templates[p] for p in pools}, cfg.discovery_file, host,
                                stop_grace_s, available_cpus, log=_print)
        self.controller = Autoscaler(pools, self.pools, cfg.sync_period_s, log=_print)
        targets = ", ".join(f"{p} {a.metric.histogram} q{a.metric.quantile} over {a.metric.window_s:g}s "
                            f"target {a.hpa.target:g}s, {a.hpa.min_replicas}..{a.hpa.max_replicas} replicas"
                            for p, a in pools.items())
        print(f"autoscale: every {cfg.sync_period_s:g} s: {targets}", flush=True)

    def tick(self) -> None:
        self.pools.tick()
        self.controller.tick()


def worker_templates(plan, cfg, cpus: list[int]) -> dict:
    """One planned worker per pool, whose command line new workers copy."""
    specs = plan(replace(cfg, num_prefill=1, num_decode=1), cpus)
    return {pool: next(s for s in specs if s.name == f"{pool}-0") for pool in POOLS}



def write_planned_discovery(cfg: AutoscaleConfig, specs) -> None:
    """The discovery file as planned, before the router starts (it reads it at once)."""
    write_pools(cfg.discovery_file, {pool: [s.address for s in specs if s.name.startswith(pool + "-")]
                                     for pool in POOLS})


class NoAutoscaler:
    """Without --autoscale: the pools keep the sizes they started with."""

    def tick(self) -> None:
        pass


def autoscaler_for(cfg, platform, supervisor, plan, cpus: list[int], stop_grace_s: float):
    """`run_platform`'s autoscaler for PlatformConfig `cfg` (a null one without --autoscale)."""
    if cfg.autoscale is None:
        return NoAutoscaler()
    return LocalAutoscaler(cfg.autoscale, platform, supervisor, worker_templates(plan, cfg, cpus), cfg.host,
                           stop_grace_s, cpus)
