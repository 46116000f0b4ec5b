"""The `pdserve` command line."""
from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys

from cli.autoscale import add_autoscale_arguments, autoscale_config_from_args
from cli.launcher import PlatformConfig, run_platform
from cli.structured_args import add_structured_arguments, structured_from_args
from engine.config import DEFAULT_MODEL, EngineConfig
from engine.dtypes import DTYPE_NAMES
from services.router.config import DEFAULT_SLO_CLASS
from services.router.main import port_or_off
from services.router.paths import PATH_POLICIES
from services.worker.config import speculative_config_arg
from services.worker.parallel_args import add_parallel_arguments, parallel_config_from_args, positive_int


def _generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text from one prompt with the offline engine")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"HF folder, .gguf file or alias (default: {DEFAULT_MODEL})")
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="send the prompt as a user message (chat template)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument("--logprobs", type=int, default=None, help="top-N logprobs per token (with --json)")
    p.add_argument("--dtype", default=EngineConfig.dtype, choices=DTYPE_NAMES)
    p.add_argument("--device", default=EngineConfig.device)
    p.add_argument("--attention-backend", default=EngineConfig.attention_backend, choices=["cpu", "torch", "triton"])
    p.add_argument("--json", action="store_true", help="print the full output as JSON")
    p.add_argument("--url", default=None, help="a router's gRPC address (host:port): stream through the platform")
    p.add_argument("--slo-class", default=DEFAULT_SLO_CLASS, help="with --url: the request's SLO class")
    add_structured_arguments(p)
    add_parallel_arguments(p)
    p.set_defaults(func=_run_generate)


def _run_generate(args) -> int:
    from engine import LLM, InvalidRequestError, SamplingParams
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=args.stop,
                            logprobs=args.logprobs, structured_outputs=structured_from_args(args))
    if not args.prompt:
        raise InvalidRequestError("prompt", "is empty")
    if args.url:
        from cli.remote_generate import generate_remote
        return generate_remote(args, params)
    parallel = parallel_config_from_args(args)
    llm = LLM(model=args.model, dtype=args.dtype, device=args.device, attention_backend=args.attention_backend,
              tensor_parallel_size=parallel.tensor_parallel_size,
              pipeline_parallel_size=parallel.pipeline_parallel_size,
              pipeline_layer_split=parallel.pipeline_layer_split, collective_timeout_s=parallel.collective_timeout_s)
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    else:
        out = llm.generate(args.prompt, params)[0]
    if args.json:
        record = dataclasses.asdict(out)
        for transient in ("new_token_ids", "new_text"):
            record.pop(transient)
        print(json.dumps(record, ensure_ascii=False, indent=2))
    else:
        print(out.text)
    return 0


def _service_parser(sub, name: str, help_text: str, module: str) -> None:
    import importlib
    mod = importlib.import_module(module)
    p = sub.add_parser(name, help=help_text)
    mod.add_arguments(p)
    p.set_defaults(func=mod.run)


def _up_parser(sub) -> None:
    # PlatformConfig's defaults are the flags' defaults: one place per setting
    p = sub.add_parser("up", help="start kvstore, prefill and decode workers and the router locally")
    p.add_argument("--model", default=PlatformConfig.model)
    p.add_argument("--prefill", type=int, default=PlatformConfig.num_prefill,
                   help="number of prefill workers (0: colocated, each decode worker prefills its own prompts)")
    p.add_argument("--decode", type=int, default=PlatformConfig.num_decode, help="number of decode workers")
    p.add_argument("--host", default=PlatformConfig.host)
    p.add_argument("--port", type=int, default=PlatformConfig.router_port, help="the router's gRPC port")
    p.add_argument("--http-port", type=port_or_off, default=PlatformConfig.http_port,
                   help="the router's OpenAI-compatible HTTP port ('off': none)")
    p.add_argument("--kvstore-port", type=int, default=PlatformConfig.kvstore_port)
    p.add_argument("--worker-base-port", type=int, default=PlatformConfig.worker_base_port)
    p.add_argument("--metrics-base-port", type=int, default=PlatformConfig.metrics_base_port)
    p.add_argument("--cpus-per-worker", type=int, default=PlatformConfig.cpus_per_worker)
    p.add_argument("--path-policy", choices=PATH_POLICIES, default=PlatformConfig.path_policy,
                   help="how the router chooses each request's path (see `pdserve router --help`)")
    p.add_argument("--short-prompt-tokens", type=int, default=PlatformConfig.short_prompt_tokens,
                   help="the threshold path policy's direct-path limit")
    p.add_argument("--kv-transport", choices=("grpc", "ucx"), default=PlatformConfig.kv_transport,
                   help="how KV blocks move between workers and the kvstore (ucx: the kvstore also serves UCX)")
    p.add_argument("--speculative-config", type=speculative_config_arg, default=None, metavar="JSON",
                   help="speculative decoding on the decode workers (colocated ones too; prefill workers never "
                        "speculate), vLLM's JSON, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}' "
                        "(see `pdserve decode --help`)")
    for pool in ("prefill", "decode"):  # after --worker-args on that pool's command lines (colocated: decode)
        p.add_argument(f"--{pool}-tensor-parallel-size", type=positive_int, default=1, metavar="T",
                       help=f"tensor parallel ranks of each {pool} worker")
        p.add_argument(f"--{pool}-pipeline-parallel-size", type=positive_int, default=1, metavar="P",
                       help=f"pipeline stages of each {pool} worker (it runs T x P processes, with T x P "
                            "times the cores of a single-process worker)")
    p.add_argument("--worker-args", default="",
                   help="extra arguments for every worker, one string (e.g. '--no-chunked-prefill')")
    p.add_argument("--router-args", default="",
                   help="extra arguments for the router, one string (e.g. '--slo-config slo.json')")
    add_autoscale_arguments(p)  # --autoscale, --autoscale-values, --autoscale-sync-s
    p.set_defaults(func=_run_up)


def _run_up(args) -> int:
    if args.prefill < 0:
        raise ValueError("--prefill: must be >= 0")
    if args.decode < 1:
        raise ValueError("--decode: needs at least one worker")
    return run_platform(PlatformConfig(
        model=args.model, num_prefill=args.prefill, num_decode=args.decode, host=args.host, router_port=args.port,
        http_port=args.http_port,
        kvstore_port=args.kvstore_port, worker_base_port=args.worker_base_port,
        metrics_base_port=args.metrics_base_port, cpus_per_worker=args.cpus_per_worker,
        path_policy=args.path_policy, short_prompt_tokens=args.short_prompt_tokens,
        kv_transport=args.kv_transport,
        worker_args=tuple(shlex.split(args.worker_args)), router_args=tuple(shlex.split(args.router_args)),
        prefill_args=_parallel_args(args, "prefill"),
        decode_args=_speculative_args(args.speculative_config) + _parallel_args(args, "decode"),
        autoscale=autoscale_config_from_args(args)))


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    _up_parser(sub)
    _service_parser(sub, "kvstore", "run the KV cache service", "services.kvstore.main")
    _service_parser(sub, "prefill", "run a prefill worker", "services.prefill.main")
    _service_parser(sub, "decode", "run a decode worker", "services.decode.main")
    _service_parser(sub, "router", "run the router", "services.router.main")
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    _service_parser(bench, "serve", "benchmark a serving endpoint (router gRPC or OpenAI HTTP)", "cli.bench.main")
    _service_parser(sub, "profile", "measure step and KV transfer costs for the simulator", "sim.measure")
    _service_parser(sub, "sim", "simulate a cluster on a Mooncake trace", "sim.main")
    _service_parser(sub, "plan", "recommend prefill:decode pool sizes from simulations", "sim.plan")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from engine.errors import InvalidRequestError, ModelLoadError
    try:
        return args.func(args)
    except (InvalidRequestError, ModelLoadError, ValueError) as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
