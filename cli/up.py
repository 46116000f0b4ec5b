"""`pdserve up`: the whole platform as local processes (cli/launcher.py starts and supervises them)."""
from __future__ import annotations

import dataclasses
import json
import os
import shlex

from pdserve.cli.autoscale import add_autoscale_arguments, autoscale_config_from_args
from pdserve.cli.launcher import MAX_ROUTERS, PlatformConfig, run_platform
from pdserve.cli.mooncake_procs import MooncakePlan
from pdserve.engine.chat import load_chat_template
from pdserve.services.common.sizes import parse_bytes
from pdserve.services.router.fronts.http.config import HttpConfig
from pdserve.services.router.main import add_api_arguments, add_path_arguments, add_port_arguments
from pdserve.services.worker.config import (add_memory_arguments, add_model_arguments, add_quantization_argument,
                                            add_speculative_argument)
from pdserve.services.worker.parallel_args import add_parallel_size_arguments, positive_int


def add_arguments(p) -> None:
    # the flags the router or the workers take are declared by them (their defaults are
    # PlatformConfig's too); up's own default to PlatformConfig's: one place per setting
    models = p.add_argument_group("the model (the workers' and the router's)")
    add_model_arguments(models)
    add_quantization_argument(models)
    p.add_argument("--prefill", type=int, default=None,
                   help="number of prefill workers (0: colocated, each decode worker prefills its own prompts; "
                        f"default: {PlatformConfig.num_prefill}, 0 with --both)")
    p.add_argument("--decode", type=int, default=None,
                   help=f"number of decode workers (default: {PlatformConfig.num_decode}, 0 with --both)")
    p.add_argument("--both", type=int, default=PlatformConfig.num_both, metavar="N",
                   help="number of workers of both roles (`pdserve decode --role both`: one engine serving the "
                        "prefill and the decode pool; see its --help for their defaults). The router lists each in "
                        "both pools: a long prompt is prefilled on one and decoded on another through the kvstore, "
                        "a short one goes direct, and no worker hands a prompt over to itself. They take the decode "
                        "workers' --decode-* parallel sizes and --speculative-config. Alone, or beside "
                        "--prefill/--decode workers (default: 0)")
    p.add_argument("--routers", type=positive_int, default=PlatformConfig.num_routers, metavar="N",
                   help="routers sharing the pools, router i on --port + i (and --http-port + i): a client "
                        "given them all goes on on another when one dies (pdserve's RouterClient resumes its "
                        f"streams there) (default: {PlatformConfig.num_routers}, at most {MAX_ROUTERS})")
    p.add_argument("--host", default=PlatformConfig.host)
    p.add_argument("--kvstore-port", type=int, default=PlatformConfig.kvstore_port)
    p.add_argument("--worker-base-port", type=int, default=PlatformConfig.worker_base_port)
    p.add_argument("--metrics-base-port", type=int, default=PlatformConfig.metrics_base_port)
    p.add_argument("--cpus-per-worker", type=int, default=PlatformConfig.cpus_per_worker)
    _add_kvstore_arguments(p)
    p.add_argument("--worker-args", default="",
                   help="extra arguments for every worker, one string (e.g. '--no-chunked-prefill')")
    p.add_argument("--router-args", default="",
                   help="extra arguments for the router, one string (e.g. '--slo-config slo.json')")
    add_autoscale_arguments(p)  # --autoscale, --autoscale-values, --autoscale-sync-s
    _add_passed_on_arguments(p)
    p.set_defaults(func=run)


def _add_kvstore_arguments(p) -> None:
    p.add_argument("--kv-transport", "--kvstore-transport", dest="kv_transport", choices=("grpc", "tcp", "ucx"),
                   default=None,
                   help=f"how KV blocks move between workers and the kvstore (default {PlatformConfig.kv_transport}; "
                        "tcp: raw frames on a TCP port of the kvstore's; grpc: its gRPC port; ucx: the kvstore also "
                        "serves UCX)")
    p.add_argument("--kvstore-backend", choices=("memory", "mooncake"), default=PlatformConfig.kvstore_backend,
                   help="where the kvstore keeps block bytes: in its own memory (default), or in Mooncake Store "
                        "(a mooncake_master and --kvstore-replicas store nodes are started; the workers move "
                        "bytes to and from them directly, the kvstore indexes them)")
    p.add_argument("--kvstore-capacity-bytes", type=parse_bytes, default=PlatformConfig.kvstore_capacity_bytes,
                   metavar="SIZE", help="block bytes the kvstore holds, e.g. 512MiB (with mooncake: each store "
                                        "node's segment; default: 1GiB)")
    p.add_argument("--kvstore-disk-dir", metavar="PATH", default=PlatformConfig.kvstore_disk_dir,
                   help="the kvstore also keeps full blocks as files here (its --disk-dir, with "
                        "--kvstore-disk-capacity-bytes): a kvstore restarted by `pdserve up` finds them again")
    p.add_argument("--kvstore-disk-capacity-bytes", type=parse_bytes, metavar="SIZE",
                   default=PlatformConfig.kvstore_disk_capacity_bytes,
                   help="block bytes the kvstore's disk tier holds, e.g. 16GiB (its --disk-capacity-bytes)")
    p.add_argument("--kvstore-replicas", type=positive_int, default=MooncakePlan.replicas,
                   help="with --kvstore-backend mooncake: copies of each block, one per store node (default: 1)")
    p.add_argument("--mooncake-base-port", type=int, default=MooncakePlan.base_port,
                   help="with --kvstore-backend mooncake: the master's RPC port; its metadata server, "
                        "metrics and the store nodes take the next ones")


def _add_passed_on_arguments(p) -> None:
    """The workers' and the router's own flags, each declared by its service, under a heading
    that says whose command lines they go to."""
    add_memory_arguments(p.add_argument_group("every worker's (see `pdserve decode --help`)"))
    add_speculative_argument(p.add_argument_group(
        "the decode workers' (colocated and --both ones too; prefill workers never speculate)"), "decode")
    # after --worker-args on that pool's command lines: a size given here stands
    sizes = p.add_argument_group("each pool's workers' (colocated and --both ones take --decode-*)")
    for pool in ("prefill", "decode"):
        add_parallel_size_arguments(sizes, pool)
    router = p.add_argument_group("the router's (see `pdserve router --help`)")
    add_api_arguments(router)
    add_port_arguments(router)
    add_path_arguments(router)


def worker_counts(args) -> tuple[int, int, int]:
    """(prefill, decode, both) workers, checked: --both alone starts only workers of both
    roles; --prefill and --decode add pure ones beside them."""
    both = args.both
    if both < 0:
        raise ValueError(f"--both: must be >= 0, got {both}")
    prefill = args.prefill if args.prefill is not None else (0 if both else PlatformConfig.num_prefill)
    decode = args.decode if args.decode is not None else (0 if both else PlatformConfig.num_decode)
    if prefill < 0:
        raise ValueError(f"--prefill: must be >= 0, got {prefill}")
    if decode < 0:
        raise ValueError(f"--decode: must be >= 0, got {decode}")
    if decode + both < 1:
        raise ValueError("--decode: needs at least one worker that decodes (--decode or --both)")
    if both and args.path_policy == "colocated":
        raise ValueError("--both: a worker of both roles is there to serve the prefill pool, which --path-policy "
                         "colocated never uses; start colocated workers with --decode N")
    if both and args.autoscale:
        raise ValueError("--both: not with --autoscale, which scales the prefill and the decode pool each on its "
                         "own metric; a worker in both pools belongs to neither's scaling")
    return prefill, decode, both


def run(args) -> int:
    num_prefill, num_decode, num_both = worker_counts(args)
    HttpConfig(tool_call_parser=args.tool_call_parser, enable_auto_tool_choice=args.enable_auto_tool_choice,
               reasoning_parser=args.reasoning_parser)  # the router's check, before any process starts
    return run_platform(PlatformConfig(
        model=args.model, revision=args.revision, quantization=args.quantization,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_offloading_size=args.kv_offloading_size,
        served_model_names=tuple(args.served_model_name), chat_template=_chat_template(args.chat_template),
        tool_call_parser=args.tool_call_parser, enable_auto_tool_choice=args.enable_auto_tool_choice,
        reasoning_parser=args.reasoning_parser,
        num_prefill=num_prefill, num_decode=num_decode, num_both=num_both, num_routers=args.routers,
        host=args.host, router_port=args.port,
        http_port=args.http_port,
        kvstore_port=args.kvstore_port, worker_base_port=args.worker_base_port,
        metrics_base_port=args.metrics_base_port, cpus_per_worker=args.cpus_per_worker,
        path_policy=args.path_policy, short_prompt_tokens=args.short_prompt_tokens,
        kv_transport=args.kv_transport or PlatformConfig.kv_transport, kvstore_backend=args.kvstore_backend,
        kvstore_capacity_bytes=args.kvstore_capacity_bytes, mooncake=_mooncake_plan(args),
        kvstore_disk_dir=_kvstore_disk_dir(args), kvstore_disk_capacity_bytes=args.kvstore_disk_capacity_bytes,
        worker_args=tuple(shlex.split(args.worker_args)), router_args=tuple(shlex.split(args.router_args)),
        prefill_args=_parallel_args(args, "prefill"),
        decode_args=_speculative_args(args.speculative_config) + _parallel_args(args, "decode"),
        autoscale=autoscale_config_from_args(args)))


def _mooncake_plan(args) -> MooncakePlan:
    if args.kvstore_backend != "mooncake":
        if args.kvstore_replicas != MooncakePlan.replicas:
            raise ValueError("--kvstore-replicas: only with --kvstore-backend mooncake")
        return MooncakePlan()
    if args.kv_transport is not None:
        raise ValueError("--kv-transport: with --kvstore-backend mooncake the bytes move over Mooncake's transfer "
                         "engine; leave --kv-transport out")
    return MooncakePlan(base_port=args.mooncake_base_port, replicas=args.kvstore_replicas)


def _kvstore_disk_dir(args) -> str | None:
    """Checked here (the kvstore would refuse it after the others started); absolute, so
    the kvstore's working directory does not matter."""
    if (args.kvstore_disk_dir is None) != (args.kvstore_disk_capacity_bytes is None):
        raise ValueError("--kvstore-disk-dir: goes with --kvstore-disk-capacity-bytes (both or neither)")
    if args.kvstore_disk_dir is not None and args.kvstore_backend != "memory":
        raise ValueError("--kvstore-disk-dir: a disk tier is for --kvstore-backend memory only")
    return None if args.kvstore_disk_dir is None else os.path.abspath(args.kvstore_disk_dir)


def _chat_template(value: str | None) -> str | None:
    """Checked here (a bad one stops `pdserve up` before any process starts); a file is passed
    to the router by its absolute path."""
    if value is None:
        return None
    load_chat_template(value)
    return os.path.abspath(value) if os.path.isfile(value) else value


def _parallel_args(args, pool: str) -> tuple[str, ...]:
    """A pool's --tensor/--pipeline-parallel-size, when not 1 (a size given in --worker-args then stands)."""
    sizes = {"--tensor-parallel-size": getattr(args, f"{pool}_tensor_parallel_size"),
             "--pipeline-parallel-size": getattr(args, f"{pool}_pipeline_parallel_size")}
    return tuple(arg for flag, size in sizes.items() if size != 1 for arg in (flag, str(size)))


def _speculative_args(spec) -> tuple[str, ...]:
    """The decode workers' --speculative-config, from the config checked here (a bad one
    stops `pdserve up` before any process starts)."""
    if spec is None:
        return ()
    return ("--speculative-config", json.dumps({k: v for k, v in dataclasses.asdict(spec).items() if v is not None}))
