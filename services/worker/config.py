"""A worker's configuration: the engine's own config dataclasses plus what the worker adds,
and the `pdserve prefill|decode` flags, which take every default from those dataclasses."""
from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field

from pdserve.engine.config import QUANTIZATION_METHODS, SCHEDULING_POLICIES, EngineConfig, SchedulerConfig
from pdserve.engine.dtypes import DTYPE_NAMES
from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.spec_decode.config import SpeculativeConfig
from pdserve.services.common import defaults
from pdserve.services.common.address import split_host_port
from pdserve.services.common.numbers import number_arg
from pdserve.services.common.security import (ClientSecurity, ServerSecurity, add_internal_client_arguments,
                                              add_internal_token_argument, add_server_tls_arguments,
                                              internal_client_security, internal_server_security)
from pdserve.services.common.sizes import parse_bytes
from pdserve.services.worker.kv_seal import KVKeys
from pdserve.services.worker.parallel_args import add_parallel_arguments, parallel_config_from_args


@dataclass(frozen=True)
class WorkerConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = defaults.HOST
    port: int = 0
    metrics_port: int | None = None
    kvstore_address: str = ""
    kvstore_transport: str = "grpc"
    # with transport "mooncake": the store node on this host to move bytes through by shared
    # memory ("auto": one the kvstore's plane names here; "off"; or its service HOST:PORT)
    mooncake_local_node: str = "auto"
    max_waiting: int = 256  # admission bound: beyond it the worker answers RESOURCE_EXHAUSTED
    lease_ttl_ms: int = 0  # a prefill's lease on the KV it wrote; 0: the kvstore's --lease-ttl-ms decides
    drain_timeout_s: float = defaults.DRAIN_TIMEOUT_S  # on shutdown: how long in-flight requests may take to finish
    security: ServerSecurity = ServerSecurity()    # what its port asks of callers (the router)
    internal: ClientSecurity = ClientSecurity()    # how it calls the kvstore
    # derived from the internal token: how its KV blocks are sealed and named (kv_seal.py);
    # None without a token (unkeyed checksums, names from token ids)
    kv_keys: KVKeys | None = None
    # the router's --served-model-name, given to the workers too: the first is the
    # `model_name` label of the vllm: metrics (empty: the engine's --model)
    served_model_names: tuple[str, ...] = ()
    # a decode worker writes each finished request's full blocks (prompt + answer) to the
    # kvstore, for the conversation's next turn (services/worker/finished_kv.py); needs
    # prefix caching (the blocks are exported from it after the request freed them)
    kv_write_finished: bool = True
    # exported bytes queued or being written at once; a request that does not fit is skipped
    kv_write_finished_max_bytes: int = 256 << 20

    @property
    def served_name(self) -> str:
        return self.served_model_names[0] if self.served_model_names else self.engine.model


_ENGINE, _SCHEDULER, _WORKER = EngineConfig(), SchedulerConfig(), WorkerConfig()
GiB = 1 << 30

SPECULATIVE_HELP = {
    "decode": "speculative decoding, vLLM's JSON: '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
              "\"prompt_lookup_min\": 1, \"prompt_lookup_max\": 4}' or '{\"method\": \"draft_model\", "
              "\"model\": \"smollm2\", \"num_speculative_tokens\": 3}'; both take \"disable_by_batch_size\" "
              "(default: off)",
    # accepted so that one argument list can serve both pools (pdserve up --worker-args, a
    # chart's shared extraArgs), as vLLM's prefill instances accept it; never acted on
    "prefill": "accepted and IGNORED: prefill workers do not speculate (a prefill-only request ends at its "
               "first token, so there is nothing to draft); set it on the decode workers",
}

# A prefill worker's steps last at most this long by default, so that a short prompt
# arriving behind a long one waits for at most one such step (with srpt it then goes
# first): docs/architecture.md, "Prefill order". A decode worker's default is none: the
# length of its steps is its streams' ITL, which the router bounds per request (it sizes
# each prompt's chunks to the ITL target of the streams it joins, prefill_chunk_tokens),
# and a colocated worker keeps token budgets, vLLM's, for the throughput it is compared on.
# A worker of both roles decodes, so its steps are ITL too, but the prompts it prefills for
# other workers come without a chunk size (a prefill request carries none): its own bound
# is the default interactive class's ITL target (decide/config.py default_slo_classes): a
# target, not a measurement (bench/serve_goodput.py --modes both measures it).
# prefill and decode: measured, docs/benchmarks_history.md, issue 33
DEFAULT_MAX_STEP_MS = {"prefill": 150.0, "decode": 0.0, "both": 100.0}

ROLE_HELP = ("what this worker serves over its one engine: decode (default), DecodeWorker only; both, "
             "PrefillWorker too, so a router may list it in both pools: it prefills long prompts whose KV goes "
             "to another worker through the kvstore, and prefills and streams direct ones itself (never handing "
             "a prompt over to itself). A both worker decodes, so its defaults are a decode worker's "
             "(--kv-write-finished on, --speculative-config applied to its decodes, --scheduling-policy srpt) "
             f"except --max-step-ms {DEFAULT_MAX_STEP_MS['both']:g}: the prompts it prefills for others come "
             "without a chunk size, and each of its steps is an inter-token gap of its own streams, so a step is "
             "bounded by the default interactive SLO class's ITL target (give your strictest itl_ms)")

KV_WRITE_FINISHED_HELP = {
    "decode": "write each finished request's full blocks (prompt + answer) to the kvstore in the background, "
              "so the conversation's next turn finds its whole history there (default: on, unless "
              "--no-prefix-caching, which it needs)",
    # accepted so that one argument list can serve both pools; a prefill worker writes its
    # prompt's blocks whatever it says (the decode reads them)
    "prefill": "accepted and IGNORED: a prefill worker always writes its prompt's blocks; set it on the decode "
               "workers",
}


QUANTIZATION_HELP = ("gguf: keep a GGUF file's Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K and Q6_K weights in their "
                     "blocks (4.5-8.5 bits a weight) and compute with them, the same tokens as the dequantized weights; fp8: an fp8 checkpoint (taken "
                     "as saved anyway). Default: the checkpoint as saved, a GGUF file dequantized to --dtype")


def add_quantization_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quantization", "-q", default=_ENGINE.quantization, choices=QUANTIZATION_METHODS,
                        help=QUANTIZATION_HELP)


def add_worker_arguments(parser: argparse.ArgumentParser, default_port: int, role: str = "decode",
                         roles: tuple[str, ...] = ()) -> None:
    """`role`: the command's; `roles`: those --role may choose (none: no --role, `role` only)."""
    if len(roles) > 1:
        parser.add_argument("--role", choices=roles, default=role, help=ROLE_HELP)
    parser.set_defaults(role=role)
    add_model_arguments(parser)
    parser.add_argument("--served-model-name", nargs="+", default=list(_WORKER.served_model_names),
                        metavar="NAME", help="the name(s) clients use, as the router's: the first is the "
                        "model_name label of the vllm: metrics (default: --model)")
    parser.add_argument("--dtype", default=_ENGINE.dtype, choices=DTYPE_NAMES)
    add_quantization_argument(parser)
    parser.add_argument("--device", default=_ENGINE.device)
    parser.add_argument("--attention-backend", default=_ENGINE.attention_backend, choices=["cpu", "torch", "triton"])
    parser.add_argument("--host", default=_WORKER.host)
    parser.add_argument("--port", type=int, default=default_port)
    parser.add_argument("--metrics-port", type=int, default=_WORKER.metrics_port)
    parser.add_argument("--kvstore", default=defaults.KVSTORE_ADDRESS, help="KV cache service address")
    parser.add_argument("--kvstore-transport", default=_WORKER.kvstore_transport,
                        choices=["grpc", "tcp", "ucx", "mooncake"],
                        help="how KV blocks move: grpc, tcp (raw frames; the kvstore serves --tcp-port), ucx (the "
                             "kvstore serves UCX), or mooncake (straight to the Mooncake Store data plane of a "
                             "kvstore run with --backend mooncake)")
    parser.add_argument("--mooncake-local-node", default=_WORKER.mooncake_local_node,
                        metavar="auto|off|HOST:PORT",
                        help="with --kvstore-transport mooncake: the Mooncake store node on this host that KV "
                             "moves through by shared memory, no TCP (this worker is its dummy client; the engine "
                             "exports into memory it maps). auto (default): the first one the kvstore names on "
                             "this host; off: every byte over the transfer engine; or the node's service address "
                             "(mooncake_client --port). A node that cannot be attached to, or that dies, means the "
                             "transfer engine")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=_ENGINE.cache.kv_cache_memory_bytes,
                        help="the KV cache's exact size per rank (default: from --gpu-memory-utilization on "
                             f"CUDA, {_ENGINE.cache.kv_cache_memory_fraction:g} of free memory on the CPU)")
    add_memory_arguments(parser)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--max-num-seqs", type=int, default=_SCHEDULER.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help=f"tokens per engine step (default {_SCHEDULER.max_num_batched_tokens}; with "
                             "--no-chunked-prefill, the max model len)")
    parser.add_argument("--long-prefill-token-threshold", type=int, default=_SCHEDULER.long_prefill_token_threshold)
    parser.add_argument("--max-model-len", type=int, default=_SCHEDULER.max_model_len)
    parser.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default="srpt",
                        help="the order of each step's prefill work: srpt (decodes first, then prompts by SLO class "
                             "and then by the tokens they still need, less the prompt tokens computed for others "
                             "since they arrived: nothing arriving after R tokens have been computed since an R-token "
                             "prompt arrived overtakes it; docs/architecture.md, Prefill order) or fcfs (vLLM's: "
                             "running first, then by class and arrival); default: srpt")
    parser.add_argument("--max-step-ms", type=_max_step_ms_arg, default=None, metavar="MS",
                        help="bound each step in time: its prompt tokens are what the measured prefill rate computes "
                             "in MS beside its decodes, never less than a block; a step without decodes may last up to "
                             "an eighth of the tightest SLO class TTFT target its requests of the last minute carried, when that "
                             "is longer (engine/core/step_bound.py); 0: token budgets only (default: "
                             f"{DEFAULT_MAX_STEP_MS['prefill']:g} on prefill workers, "
                             f"{DEFAULT_MAX_STEP_MS['decode']:g} on decode workers, "
                             f"{DEFAULT_MAX_STEP_MS['both']:g} on workers of --role both, "
                             "0 with --no-chunked-prefill)")
    parser.add_argument("--no-chunked-prefill", action="store_true",
                        help="schedule each prompt whole in one step; --max-num-batched-tokens must "
                             "then be at least the max model len")
    parser.add_argument("--cuda-graph-batch-sizes", type=_batch_sizes, default=_ENGINE.cuda_graph_batch_sizes,
                        help="decode batch sizes captured as CUDA graphs at start-up, e.g. 1,2,4,8,16,32,64 "
                             "(--device cuda with --attention-backend triton; default: none, all steps eager)")
    add_speculative_argument(parser, role)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads for this worker")
    add_parallel_arguments(parser)
    parser.add_argument("--drain-timeout-s", type=float, default=_WORKER.drain_timeout_s,
                        help="on SIGTERM: how long in-flight requests may take to finish")
    parser.add_argument("--kv-write-finished", action=argparse.BooleanOptionalAction, default=None,
                        help=KV_WRITE_FINISHED_HELP[role])
    parser.add_argument("--kv-write-finished-max-bytes", type=parse_bytes, default=_WORKER.kv_write_finished_max_bytes,
                        metavar="SIZE", help="with --kv-write-finished: exported KV bytes queued or being written at "
                        "once, e.g. 512MiB; a finished request whose blocks do not fit is not written (counted) "
                        f"(default: {_WORKER.kv_write_finished_max_bytes >> 20}MiB)")
    add_internal_token_argument(parser)
    add_server_tls_arguments(parser, "this worker's gRPC port")
    add_internal_client_arguments(parser)


# The groups below are also `pdserve up`'s, which passes them on to its workers: it declares
# them through these functions, under a heading of their own in its --help.

def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=_ENGINE.model,
                        help="HF folder, .gguf file, alias, or org/name from the local Hugging Face cache")
    parser.add_argument("--revision", default=_ENGINE.revision,
                        help="with --model org/name: the branch, tag or commit in the cache (default: main)")


def add_memory_arguments(parser: argparse.ArgumentParser) -> None:
    """The GPU memory a worker may take and its host tier."""
    parser.add_argument("--gpu-memory-utilization", type=gpu_memory_utilization_arg,
                        default=_ENGINE.cache.gpu_memory_utilization, metavar="FRACTION",
                        help="the share of the GPU's whole memory this worker may use, weights and activations "
                             "included; the KV cache gets what is left (vLLM's). Ignored on the CPU and with "
                             "--kv-cache-memory-bytes")
    parser.add_argument("--kv-offloading-size", type=kv_offloading_size_arg, default=None, metavar="GiB",
                        help="host memory keeping the KV blocks the cache evicts, copied back on a prefix hit "
                             "before the kvstore is asked (vLLM's flag, in GiB, the total over a worker's "
                             "tensor/pipeline ranks; docs/kv_tiers.md). Needs prefix caching. Default: off")


def add_speculative_argument(parser: argparse.ArgumentParser, role: str = "decode") -> None:
    parser.add_argument("--speculative-config", type=speculative_config_arg, default=None, metavar="JSON",
                        help=SPECULATIVE_HELP[role])


def worker_config_from_args(args) -> WorkerConfig:
    scheduler = SchedulerConfig(
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=_max_num_batched_tokens(args),
        long_prefill_token_threshold=args.long_prefill_token_threshold, max_model_len=args.max_model_len,
        enable_chunked_prefill=not args.no_chunked_prefill, scheduling_policy=args.scheduling_policy,
        max_step_ms=_max_step_ms(args))
    internal = internal_client_security(args)
    cache = dataclasses.replace(_ENGINE.cache, enable_prefix_caching=not args.no_prefix_caching,
                                kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                                gpu_memory_utilization=args.gpu_memory_utilization,
                                kv_offloading_bytes=_kv_offloading_bytes(args))
    engine = dataclasses.replace(_ENGINE, model=args.model, revision=args.revision, dtype=args.dtype,
                                 quantization=args.quantization,
                                 device=args.device,
                                 attention_backend=args.attention_backend, cache=cache, scheduler=scheduler,
                                 cuda_graph_batch_sizes=args.cuda_graph_batch_sizes,
                                 speculative_config=args.speculative_config,
                                 parallel=parallel_config_from_args(args))
    return with_kv_keys(WorkerConfig(engine=engine, host=args.host, port=args.port, metrics_port=args.metrics_port,
                        kvstore_address=args.kvstore, kvstore_transport=args.kvstore_transport,
                        mooncake_local_node=_mooncake_local_node(args),
                        drain_timeout_s=args.drain_timeout_s, security=internal_server_security(args),
                        internal=internal, served_model_names=tuple(args.served_model_name),
                        kv_write_finished=_kv_write_finished(args),
                        kv_write_finished_max_bytes=args.kv_write_finished_max_bytes),
                        KVKeys.from_token(internal.token))


def with_kv_keys(cfg: WorkerConfig, keys: KVKeys | None) -> WorkerConfig:
    """`cfg` sealing its blocks with `keys` and naming them under their names key."""
    cache = dataclasses.replace(cfg.engine.cache, block_names_key=keys.names_key if keys else b"")
    return dataclasses.replace(cfg, kv_keys=keys, engine=dataclasses.replace(cfg.engine, cache=cache))


def _mooncake_local_node(args) -> str:
    value = args.mooncake_local_node
    if value not in ("auto", "off"):
        split_host_port(value, "--mooncake-local-node")
    return value


def _kv_write_finished(args) -> bool:
    """On by default; off by default without prefix caching, where it is refused if asked
    for: the finished request's blocks are exported from the prefix cache."""
    if args.kv_write_finished and args.no_prefix_caching:
        raise ValueError("--kv-write-finished: needs prefix caching (drop --no-prefix-caching, or write nothing "
                         "with --no-kv-write-finished)")
    return not args.no_prefix_caching if args.kv_write_finished is None else args.kv_write_finished


def _max_step_ms(args) -> float:
    """The role's default unless given; none without chunked prefill, which it needs: a
    step bounded in time splits prompts."""
    if args.max_step_ms is None:
        return 0.0 if args.no_chunked_prefill else DEFAULT_MAX_STEP_MS[args.role]
    if args.max_step_ms and args.no_chunked_prefill:
        raise ValueError("--max-step-ms: bounding a step in time splits prompts, so it needs chunked prefill "
                         "(drop --no-chunked-prefill, or give --max-step-ms 0)")
    return args.max_step_ms


_max_step_ms_arg = number_arg(float, "a number of milliseconds", low=0, note="0: no time bound")
# a fraction in (0, 1], named as the engine's field names it (pdserve up's flag parses the same way)
gpu_memory_utilization_arg = number_arg(float, "", low=0, low_open=True, high=1, field="gpu_memory_utilization")
# GiB >= 0 (0: off), as vLLM's --kv-offloading-size (pdserve up's flag parses the same way)
kv_offloading_size_arg = number_arg(float, "a number of GiB", low=0, note="0: off")


def _kv_offloading_bytes(args) -> int | None:
    """--kv-offloading-size in bytes; refused, naming it, beside --no-prefix-caching."""
    if not args.kv_offloading_size:
        return None
    if args.no_prefix_caching:
        raise InvalidRequestError("--kv-offloading-size", "the host tier keeps the blocks the prefix cache evicts: "
                                                          "it cannot go with --no-prefix-caching")
    return int(args.kv_offloading_size * GiB)


def _batch_sizes(text: str) -> tuple[int, ...]:
    """Comma-separated sizes: 1,2,4,8 -> (1, 2, 4, 8); empty -> (). The engine config checks them."""
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated batch sizes like 1,2,4,8, got {text!r}") from None


def speculative_config_arg(text: str) -> SpeculativeConfig | None:
    """--speculative-config's JSON into the engine's SpeculativeConfig, which checks every key;
    a bad one is refused naming it (speculative_config.<key>). '{}' or 'null': off."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"speculative_config: not valid JSON ({e}): {text!r}") from None
    try:
        return SpeculativeConfig.from_dict(None if value == {} else value)
    except InvalidRequestError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _max_num_batched_tokens(args) -> int | None:
    """Unchunked, the budget must hold the longest prompt: None lets the engine use max_model_len,
    which is only known once the model and the KV pool are sized."""
    if args.max_num_batched_tokens is not None:
        return args.max_num_batched_tokens
    return None if args.no_chunked_prefill else _SCHEDULER.max_num_batched_tokens
