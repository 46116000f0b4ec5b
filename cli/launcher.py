"""`pdserve up`: the whole platform as local processes on loopback.

kvstore, N prefill workers, M decode workers, B workers of both roles (`pdserve decode
--role both`, listed in both of the router's pools) and the router, each a `pdserve <role>`
process. Like a cluster giving each pod its own GPU, each worker gets its own CPU cores
(affinity and torch threads). Logs are streamed with a per-process prefix. A process that
dies is restarted on its own port while the rest keep serving (cli/supervisor.py);
Ctrl-C (or SIGTERM) of `pdserve up` itself drains and stops them all.

Startup goes by stages, each serving before the next starts: with the Mooncake backend
its master, then its store nodes (serving: their ports accept); kvstore and workers, each
until its own gRPC health service says SERVING; then the router, whose first load poll
(made before it serves) so sees every worker, until its health says it is ready
(services/router/state/readiness.py).
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from pdserve.services.common.defaults import (DEFAULT_MODEL, DRAIN_TIMEOUT_S, HOST, KVSTORE_PORT, METRICS_BASE_PORT, PREFILL_PORT,
                                              ROUTER_HTTP_PORT, ROUTER_PORT)
from pdserve.services.common.address import split_host_port
from pdserve.services.common.auth import INTERNAL_TOKEN_ENV
from pdserve.services.common.grpc_server import is_serving
from pdserve.engine.config import CacheConfig
from pdserve.services.router.config import PathConfig, RouterConfig
from pdserve.services.worker.parallel_args import PIPELINE_PARALLEL_FLAGS, TENSOR_PARALLEL_FLAGS
from pdserve.cli.mooncake_procs import MooncakePlan
from pdserve.cli.pinning import pin_process
from pdserve.cli.supervisor import Supervisor
from pdserve.cli.autoscale import AutoscaleConfig, autoscaler_for, router_discovery_args, write_planned_discovery

ROUTER = "router"
MAX_ROUTERS = 8
KVSTORE = "kvstore"
# each worker role's `pdserve` subcommand
WORKER_COMMANDS = {"prefill": ("prefill",), "decode": ("decode",), "both": ("decode", "--role", "both")}
# On stop: the processes' own drain (their --drain-timeout-s default), plus time to exit
STOP_GRACE_S = DRAIN_TIMEOUT_S + 5.0


@dataclass(frozen=True)
class PlatformConfig:
    model: str = DEFAULT_MODEL
    revision: str | None = None               # of a model named org/name in the Hugging Face cache
    quantization: str | None = None           # every worker's --quantization (None: the checkpoint as saved)
    gpu_memory_utilization: float = CacheConfig.gpu_memory_utilization  # both pools' workers (CUDA only)
    kv_offloading_size: float | None = None   # both pools' workers' host tier, GiB (--kv-offloading-size); None: off
    served_model_names: tuple[str, ...] = ()  # the router's --served-model-name; empty: --model
    chat_template: str | None = None          # the router's --chat-template (a file, absolute, or the template)
    tool_call_parser: str | None = None       # the router's --tool-call-parser, --enable-auto-tool-choice and
    enable_auto_tool_choice: bool = False     # --reasoning-parser (vLLM's flags)
    reasoning_parser: str | None = None
    num_prefill: int = 1
    num_decode: int = 1
    num_both: int = 0   # workers of both roles: in the prefill and the decode pool alike
    host: str = HOST
    router_port: int = ROUTER_PORT
    http_port: int | None = ROUTER_HTTP_PORT  # the OpenAI-compatible API; None: off
    # routers sharing the pools: router i serves gRPC on router_port + i, HTTP on http_port + i
    # (a client moves to another when one dies: RouterClient resumes its streams there)
    num_routers: int = 1
    kvstore_port: int = KVSTORE_PORT
    worker_base_port: int = PREFILL_PORT      # prefill, decode, then both-role workers, one port each
    metrics_base_port: int = METRICS_BASE_PORT
    cpus_per_worker: int | None = None
    path_policy: str = PathConfig.policy
    short_prompt_tokens: int = RouterConfig.short_prompt_tokens
    # "tcp": raw frames on a port of the kvstore's, received into pooled buffers; "grpc": the
    # kvstore's gRPC port. tcp by default: a decode worker receiving a 1,900-token prompt's
    # KV over gRPC spent ~1.5 s at half its core in the kernel (fresh receive buffers) while
    # it decoded others; over TCP, next to nothing (docs/benchmarks_history.md, issue 33)
    kv_transport: str = "tcp"                 # "tcp"/"ucx": the kvstore also serves it, workers move KV over it
    # "mooncake": block bytes in Mooncake Store (cli/mooncake_procs.py: a master and store
    # nodes), the kvstore their index and leases, the workers on transport "mooncake"
    kvstore_backend: str = "memory"
    kvstore_capacity_bytes: int = 1 << 30     # the kvstore's (with mooncake: each store node's segment)
    kvstore_disk_dir: str | None = None       # the kvstore's disk tier (--disk-dir), with its capacity
    kvstore_disk_capacity_bytes: int | None = None
    mooncake: MooncakePlan = field(default_factory=MooncakePlan)
    worker_args: tuple[str, ...] = ()
    prefill_args: tuple[str, ...] = ()  # after worker_args, for prefill workers only
    decode_args: tuple[str, ...] = ()   # after worker_args, for workers that decode (colocated and both ones too)
    router_args: tuple[str, ...] = ()
    startup_timeout_s: float = 300.0
    # every process of this platform requires (and sends) it on the internal ports; fresh
    # per platform, handed over in the environment (never argv: `ps` shows that to everyone)
    internal_token: str = field(default_factory=lambda: secrets.token_urlsafe(32), repr=False)
    autoscale: AutoscaleConfig | None = None  # --autoscale: the router follows a discovery file (cli/autoscale.py)

    def __post_init__(self):
        if not 1 <= self.num_routers <= MAX_ROUTERS:
            raise ValueError(f"--routers: {self.num_routers} is not between 1 and {MAX_ROUTERS}")

    @property
    def num_workers(self) -> int:
        return self.num_prefill + self.num_decode + self.num_both

    @property
    def router_addresses(self) -> list[str]:
        return [f"{self.host}:{self.router_port + i}" for i in range(self.num_routers)]


@dataclass
class ProcessSpec:
    name: str
    argv: list[str]
    address: str
    metrics_port: int
    cpus: list[int] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict, repr=False)  # on top of the launcher's own
    health: str = "grpc"  # serving when: "grpc" health says SERVING; "tcp": its address accepts
    stage: int = 1        # started in stage order, each stage serving before the next starts


def split_cpus(available: list[int], num_workers: int, per_worker: int | None,
               ranks: list[int] | None = None) -> list[list[int]]:
    """Cores for each worker: an even split by default, `per_worker` each when given
    (wrapping around when the machine has fewer cores than asked for). A worker of
    ranks[w] processes (tensor x pipeline parallel) counts as that many single-rank
    workers: it gets ranks[w] times the cores, each core at most once."""
    if num_workers == 0:
        return []
    ranks = ranks or [1] * num_workers
    if per_worker is None:
        per_worker = max(1, len(available) // sum(ranks))
    starts = [per_worker * sum(ranks[:w]) for w in range(num_workers)]
    return [list(dict.fromkeys(available[(start + i) % len(available)] for i in range(per_worker * r)))
            for start, r in zip(starts, ranks)]


def worker_ranks(argv: list[str] | tuple[str, ...]) -> int:
    """How many processes a worker's command line runs: tensor x pipeline parallel size,
    each flag's last value winning, as argparse reads it (a bad value: the worker refuses it)."""
    def last(flags: tuple[str, ...]) -> int:
        value = "1"
        for i, arg in enumerate(argv):
            name, eq, inline = arg.partition("=")
            if name in flags:
                value = inline if eq else (argv[i + 1] if i + 1 < len(argv) else "1")
        return int(value) if value.isdigit() and int(value) > 0 else 1
    return last(TENSOR_PARALLEL_FLAGS) * last(PIPELINE_PARALLEL_FLAGS)


def shared_service_cpus(roles: list[str], cpu_sets: list[list[int]]) -> list[int]:
    """The cores the kvstore and the router run on: the prefill workers' where they have
    cores of their own, so that the decode workers' cores only decode. Left to the OS
    (an empty list), a kvstore receiving a long prompt's KV lands on the idle-looking
    decode core, the only one not busy prefilling: measured, a decode step during a
    1,900-token handoff took 2x its CPU time in wall time (bench/serve_itl_vs_vllm.py
    --bursts). The prefill pool is the throughput pool; it absorbs their work. None
    (empty) when there is no prefill worker or its cores are shared with decoding ones."""
    prefill = {c for role, cpus in zip(roles, cpu_sets) if role == "prefill" for c in cpus}
    decoding = {c for role, cpus in zip(roles, cpu_sets) if role != "prefill" for c in cpus}
    if not prefill or not decoding or prefill & decoding:
        return []
    return sorted(prefill)


def plan(cfg: PlatformConfig, available_cpus: list[int]) -> list[ProcessSpec]:
    """Every process of the platform and its command line, in start order within each stage:
    the kvstore, the workers, the router, then Mooncake's master and store nodes."""
    roles = worker_roles(cfg)
    cpu_sets = split_cpus(available_cpus, len(roles), cfg.cpus_per_worker,
                          [worker_ranks((*cfg.worker_args, *_pool_args(cfg, role))) for role in roles])
    workers = _worker_specs(cfg, roles, cpu_sets)
    kvstore, routers = _kvstore_spec(cfg), [_router_spec(cfg, workers, roles, i) for i in range(cfg.num_routers)]
    if cfg.autoscale is None:  # an autoscaler places later workers on any core
        for spec in (kvstore, *routers):
            spec.cpus = shared_service_cpus(roles, cpu_sets)
    specs = [kvstore, *workers, *routers, *_mooncake_specs(cfg)]
    for spec in specs:
        spec.env[INTERNAL_TOKEN_ENV] = cfg.internal_token
        if cfg.kvstore_backend == "mooncake":  # its glog INFO lines (every connection, segment) would drown the rest
            spec.env.setdefault("GLOG_minloglevel", "1")
    return specs


def worker_roles(cfg: PlatformConfig) -> list[str]:
    """Each worker's role, in port order: prefill, decode, then both-role workers."""
    return ["prefill"] * cfg.num_prefill + ["decode"] * cfg.num_decode + ["both"] * cfg.num_both


def _cli() -> list[str]:
    # -P: the working directory stays off sys.path, so a child runs the installed package
    # (a folder named like one of its packages where `pdserve up` was started cannot shadow it)
    return [sys.executable, "-P", "-m", "pdserve.cli.main"]


def _kvstore_address(cfg: PlatformConfig) -> str:
    return f"{cfg.host}:{cfg.kvstore_port}"


def _kvstore_spec(cfg: PlatformConfig) -> ProcessSpec:
    # TCP or UCX on a free port: workers ask the kvstore for it (gRPC metadata on Stats)
    mooncake = cfg.kvstore_backend == "mooncake"
    kv_port = [] if mooncake else {"ucx": ["--ucx-port", "0"], "tcp": ["--tcp-port", "0"]}.get(cfg.kv_transport, [])
    backend = cfg.mooncake.kvstore_args(cfg.host, cfg.kvstore_capacity_bytes) if mooncake else \
        ["--capacity-bytes", str(cfg.kvstore_capacity_bytes)]
    if cfg.kvstore_disk_dir is not None:
        backend = [*backend, "--disk-dir", cfg.kvstore_disk_dir,
                   "--disk-capacity-bytes", str(cfg.kvstore_disk_capacity_bytes)]
    argv = [*_cli(), "kvstore", "--host", cfg.host, "--port", str(cfg.kvstore_port),
            "--metrics-port", str(cfg.metrics_base_port), *kv_port, *backend]
    return ProcessSpec(KVSTORE, argv, _kvstore_address(cfg), cfg.metrics_base_port)


def _pool_args(cfg: PlatformConfig, role: str) -> tuple[str, ...]:
    """A pool's own arguments, after --worker-args: workers that decode share the decode pool's."""
    return cfg.prefill_args if role == "prefill" else cfg.decode_args


def _worker_specs(cfg: PlatformConfig, roles: list[str], cpu_sets: list[list[int]]) -> list[ProcessSpec]:
    """One per worker, named by role and its index in that role (prefill-0, decode-1, both-0);
    ports and metrics ports from the base ports on, in `roles` order."""
    numbered = {role: 0 for role in roles}
    specs = []
    for i, (role, cpus) in enumerate(zip(roles, cpu_sets)):
        name, numbered[role] = f"{role}-{numbered[role]}", numbered[role] + 1
        specs.append(_worker_spec(cfg, role, name, cfg.worker_base_port + i, cfg.metrics_base_port + 1 + i, cpus))
    return specs


def _worker_spec(cfg: PlatformConfig, role: str, name: str, port: int, metrics_port: int,
                 cpus: list[int]) -> ProcessSpec:
    kv_transport = "mooncake" if cfg.kvstore_backend == "mooncake" else cfg.kv_transport
    offloading = ["--kv-offloading-size", str(cfg.kv_offloading_size)] if cfg.kv_offloading_size else []
    argv = [*_cli(), *WORKER_COMMANDS[role], "--model", cfg.model, "--host", cfg.host,
            "--port", str(port), "--metrics-port", str(metrics_port), "--kvstore", _kvstore_address(cfg),
            "--kvstore-transport", kv_transport, "--threads", str(len(cpus)), *_revision_args(cfg),
            *(["--quantization", cfg.quantization] if cfg.quantization else []),
            "--gpu-memory-utilization", str(cfg.gpu_memory_utilization),
            *offloading, *_served_name_args(cfg), *cfg.worker_args, *_pool_args(cfg, role)]
    return ProcessSpec(name, argv, f"{cfg.host}:{port}", metrics_port, cpus)


def router_name(i: int) -> str:
    """Router i's process name: "router", then "router-1", "router-2", ..."""
    return ROUTER if i == 0 else f"{ROUTER}-{i}"


def _router_spec(cfg: PlatformConfig, workers: list[ProcessSpec], roles: list[str], i: int = 0) -> ProcessSpec:
    """Router i of cfg.num_routers: the same pools, its own ports."""
    metrics_port = cfg.metrics_base_port + 1 + len(workers) + i
    port = cfg.router_port + i
    # a worker of both roles is in both pools (the router never hands a prompt to itself)
    prefill_pool = [w.address for w, role in zip(workers, roles) if role in ("prefill", "both")]
    decode_pool = [w.address for w, role in zip(workers, roles) if role in ("decode", "both")]
    argv = [*_cli(), ROUTER, "--model", cfg.model, "--host", cfg.host, "--port", str(port),
            "--metrics-port", str(metrics_port), "--kvstore", _kvstore_address(cfg),
            "--path-policy", cfg.path_policy, "--short-prompt-tokens", str(cfg.short_prompt_tokens),
            "--decode", ",".join(decode_pool)]
    if prefill_pool:  # none: colocated, the decode workers prefill every prompt
        argv += ["--prefill", ",".join(prefill_pool)]
    argv += ["--http-port", "off" if cfg.http_port is None else str(cfg.http_port + i), *_revision_args(cfg)]
    argv += _served_name_args(cfg)
    if cfg.chat_template is not None:
        argv += ["--chat-template", cfg.chat_template]
    argv += [*_output_parser_args(cfg), *cfg.router_args, *router_discovery_args(cfg.autoscale)]
    return ProcessSpec(router_name(i), argv, f"{cfg.host}:{port}", metrics_port, stage=2)


def _mooncake_specs(cfg: PlatformConfig) -> list[ProcessSpec]:
    if cfg.kvstore_backend != "mooncake":
        return []
    return [ProcessSpec(name, argv, address, metrics_port, health="tcp", stage=stage,
                        env=cfg.mooncake.node_env(cfg.host) if name.startswith("store-") else {})
            for name, argv, address, metrics_port, stage in
            cfg.mooncake.processes(cfg.host, cfg.kvstore_capacity_bytes)]


def _revision_args(cfg: PlatformConfig) -> list[str]:
    return ["--revision", cfg.revision] if cfg.revision is not None else []


def _served_name_args(cfg: PlatformConfig) -> list[str]:
    """The router's, and the workers' too: they label their vllm: metrics with the name clients use."""
    return ["--served-model-name", *cfg.served_model_names] if cfg.served_model_names else []


def _output_parser_args(cfg: PlatformConfig) -> list[str]:
    args = ["--tool-call-parser", cfg.tool_call_parser] if cfg.tool_call_parser is not None else []
    args += ["--enable-auto-tool-choice"] if cfg.enable_auto_tool_choice else []
    return args + (["--reasoning-parser", cfg.reasoning_parser] if cfg.reasoning_parser is not None else [])


class Platform:
    def __init__(self, specs: list[ProcessSpec], out=sys.stdout):
        self.specs = specs
        self.out = out
        self.procs: dict[str, subprocess.Popen] = {}
        self.started: dict[str, float] = {}  # when each process was last started (monotonic)
        self._print_lock = threading.Lock()

    def start(self, timeout_s: float) -> None:
        """Start every process and return once the platform serves: kvstore and workers
        first; the router once they all serve, so that its first poll already finds every
        worker (a request sent right away is not routed as if the pools were smaller)."""
        deadline = time.monotonic() + timeout_s
        for stage in sorted({s.stage for s in self.specs}):
            group = [s for s in self.specs if s.stage == stage]
            for spec in group:
                self.procs[spec.name] = self._spawn(spec)
            self._wait_serving(group, deadline, timeout_s)

    def _spawn(self, spec: ProcessSpec) -> subprocess.Popen:
        env = dict(os.environ, PYTHONUNBUFFERED="1", **spec.env)
        if spec.cpus:
            env["OMP_NUM_THREADS"] = str(len(spec.cpus))
        proc = subprocess.Popen(spec.argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if spec.cpus:
            pin_process(proc.pid, spec.cpus)
        self.started[spec.name] = time.monotonic()
        threading.Thread(target=self._pump, args=(spec.name, proc), daemon=True).start()
        return proc

    def _pump(self, name: str, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            with self._print_lock:
                print(f"[{name:>9}] {line}", end="", file=self.out, flush=True)

    def _wait_serving(self, specs: list[ProcessSpec], deadline: float, timeout_s: float) -> None:
        """Until each of `specs` says SERVING on its gRPC health service (the router: ready)."""
        pending = {s.name: s for s in specs}
        while True:
            dead = self.dead()
            if dead:
                raise RuntimeError(f"{dead} exited during startup (code {self.procs[dead].returncode})")
            pending = {n: s for n, s in pending.items() if not _serves(s)}
            if not pending:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"not healthy after {timeout_s:.0f} s: {', '.join(sorted(pending))}")
            time.sleep(0.2)

    def dead(self) -> str | None:
        return next((n for n, p in self.procs.items() if p.poll() is not None), None)

    def restart(self, name: str) -> subprocess.Popen:
        """Start `name` again as planned: same argv, same port (the supervisor calls it)."""
        spec = next(s for s in self.specs if s.name == name)
        self.procs[name] = self._spawn(spec)
        return self.procs[name]

    def launch(self, spec: ProcessSpec) -> subprocess.Popen:
        """Start a process that was not planned (a worker the autoscaler adds)."""
        self.specs.append(spec)
        self.procs[spec.name] = self._spawn(spec)
        return self.procs[spec.name]

    def remove(self, name: str) -> None:
        """Forget a process that has exited for good (a worker the autoscaler drained)."""
        self.specs = [s for s in self.specs if s.name != name]
        self.procs.pop(name, None)
        self.started.pop(name, None)

    def serving(self, name: str) -> bool:
        """Whether `name` says SERVING on its gRPC health service (the router: ready)."""
        return _serves(next(s for s in self.specs if s.name == name))

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM in order, each group drained before the next: the router first (its
        streams finish on workers still running), then the workers (a prefill's last KV
        writes reach a kvstore still running), then the kvstore. What still runs after
        `grace_s` (per group) is killed."""
        routers = [s.name for s in self.specs if s.stage == 2]
        workers = [s.name for s in self.specs if s.name != KVSTORE and s.stage == 1]
        data_plane = sorted((s for s in self.specs if s.stage < 1), key=lambda s: -s.stage)
        for group in (routers, workers, [KVSTORE], *([s.name] for s in data_plane)):
            procs = [self.procs[name] for name in group if name in self.procs]
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for proc in procs:
                try:
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def _serves(spec: ProcessSpec) -> bool:
    if spec.health == "tcp":
        try:
            socket.create_connection(split_host_port(spec.address, spec.name), timeout=0.5).close()
            return True
        except OSError:
            return False
    return is_serving(spec.address, timeout=0.5)


def run_platform(cfg: PlatformConfig) -> int:
    cpus = sorted(os.sched_getaffinity(0))
    platform = Platform(plan(cfg, cpus))
    if cfg.autoscale is not None:
        write_planned_discovery(cfg.autoscale, platform.specs)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        platform.start(cfg.startup_timeout_s)
        _print_endpoints(platform, cfg)
        supervisor = Supervisor(platform)  # from now on a process that dies is restarted
        autoscaler = autoscaler_for(cfg, platform, supervisor, plan, cpus, STOP_GRACE_S)
        while not stop.is_set():
            supervisor.tick()
            autoscaler.tick()
            if all(router_name(i) in supervisor.gave_up for i in range(cfg.num_routers)):  # requests enter there
                print("pdserve up: error: the router stays down, nothing can serve; stopping all", file=sys.stderr)
                return 1
            stop.wait(0.2)
        return 0
    except (RuntimeError, TimeoutError) as e:
        print(f"pdserve up: error: {e}", file=sys.stderr)
        return 1
    finally:
        platform.stop()
        if cfg.autoscale is not None:  # the discovery file's own temporary directory
            shutil.rmtree(os.path.dirname(cfg.autoscale.discovery_file), ignore_errors=True)
        print("pdserve stopped: every process it started has exited", flush=True)


def _print_endpoints(platform: Platform, cfg: PlatformConfig) -> None:
    lines = ["pdserve is up:"]
    for s in platform.specs:
        cpus = f"  cpus {s.cpus}" if s.cpus else ""
        lines.append(f"  {s.name:<10} {s.health} {s.address:<18} metrics http://{cfg.host}:{s.metrics_port}/metrics"
                     f"  pid {platform.procs[s.name].pid}{cpus}")
    if cfg.http_port is not None:
        lines += [f"  OpenAI API  http://{cfg.host}:{cfg.http_port + i}/v1" for i in range(cfg.num_routers)]
    lines.append(f"try: pdserve generate --url {','.join(cfg.router_addresses)} --prompt 'Hello'   (Ctrl-C stops all)")
    print("\n".join(lines), flush=True)
