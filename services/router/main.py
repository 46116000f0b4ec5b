"""`pdserve router`: run the router in front of the prefill and decode pools (static lists or Kubernetes discovery)."""
from __future__ import annotations

import argparse
import logging

from pdserve.services.common.address import parse_addresses
from pdserve.services.common.defaults import DRAIN_TIMEOUT_S, KVSTORE_ADDRESS
from pdserve.services.common.numbers import number_arg, port_arg
from pdserve.services.common.process import configure_logging, wait_for_shutdown
from pdserve.services.common.security import internal_client_security, server_tls_from_args
from pdserve.services.router import security
from pdserve.services.router.config import (DEFAULT_SLO_CLASS, PLACEMENTS, PathConfig, RouterConfig, SaturationConfig,
                                            default_slo_classes, load_slo_classes)
from pdserve.services.router.decide.paths import PATH_POLICIES
from pdserve.services.router.fronts.http.config import HttpConfig
from pdserve.services.router.fronts.http.parsing import REASONING_PARSERS, TOOL_PARSERS
from pdserve.services.router.state.k8s_discovery import add_discovery_arguments, discovery_from_args

logger = logging.getLogger(__name__)
_drain_timeout = number_arg(float, "a number of seconds", low=0)
_port_or_off = port_arg(note="or off")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # defaults come from the config dataclasses: one place per setting
    parser.add_argument("--model", default=RouterConfig.model,
                        help="the served model: HF folder, .gguf file, alias, or org/name from the local Hugging "
                             "Face cache (the workers' --model)")
    parser.add_argument("--revision", default=RouterConfig.revision,
                        help="with --model org/name: the branch, tag or commit in the cache (default: main)")
    add_api_arguments(parser)
    parser.add_argument("--prefill", action="append", default=[], metavar="HOST:PORT",
                        help="prefill worker address (repeatable, or a comma-separated list); "
                             "none: colocated, the decode workers prefill every prompt. A worker of both roles "
                             "(`pdserve decode --role both`) is listed here and in --decode: no prompt is ever "
                             "handed over from it to itself while another worker is up (docs/router.md)")
    parser.add_argument("--decode", action="append", default=[], metavar="HOST:PORT",
                        help="decode worker address (repeatable, or a comma-separated list)")
    parser.add_argument("--kvstore", default=KVSTORE_ADDRESS, help="KV cache service address (lease releases)")
    parser.add_argument("--host", default=RouterConfig.host)
    add_port_arguments(parser)
    parser.add_argument("--metrics-port", type=int, default=None, help="serve /metrics on this port")
    add_path_arguments(parser)
    parser.add_argument("--min-direct-chunk-tokens", type=int, default=PathConfig.min_direct_chunk_tokens,
                        help="the adaptive policy: the smallest prefill chunk it asks of a decode worker")
    parser.add_argument("--rescue-step-ms", type=float, default=PathConfig.rescue_step_ms, metavar="MS",
                        help="the adaptive policy: a prompt the prefill pool would make late, taken by a decode "
                             "worker whose streams have the TPOT room for it, runs in steps of up to this long "
                             "(0: in the chunks the streams' ITL room allows)")
    parser.add_argument("--placement", choices=PLACEMENTS, default=RouterConfig.placement,
                        help="how a pool's worker is chosen: 'kv' by the prompt prefix each worker holds "
                             "(its KV events) minus its load, 'affinity' by the first 16 tokens' hash, "
                             "'least_loaded'")
    parser.add_argument("--kv-store-weight", type=float, default=RouterConfig.kv_store_weight,
                        help="kv placement: what a prompt token the worker could import from the kvstore is "
                             "worth, against one in its device prefix cache (0..1, at most --kv-host-weight)")
    parser.add_argument("--kv-host-weight", type=float, default=RouterConfig.kv_host_weight,
                        help="kv placement: what a prompt token in the worker's host memory (a copy back) is "
                             "worth, against one in its device prefix cache (--kv-store-weight..1)")
    parser.add_argument("--slo-config", default=None,
                        help='JSON file of SLO classes: {"interactive": {"ttft_ms": .., "itl_ms": .., '
                             '"priority": 0, "max_queue_ms": ..}, ...} (default: interactive and batch)')
    parser.add_argument("--max-model-len", type=int, default=None, help="default: the model's context")
    parser.add_argument("--poll-interval-s", type=float, default=RouterConfig.poll_interval_s,
                        help="worker load poll period")
    parser.add_argument("--max-worker-waiting", type=int, default=SaturationConfig.max_waiting,
                        help="a worker with this many requests waiting is saturated")
    parser.add_argument("--max-in-flight-per-worker", type=int, default=SaturationConfig.max_in_flight_per_worker,
                        help="requests this router keeps outstanding on one worker at most")
    parser.add_argument("--retry-after-ms", type=int, default=RouterConfig.retry_after_ms,
                        help="the hint sent with RESOURCE_EXHAUSTED")
    parser.add_argument("--grammar-compile-timeout-s", type=float, default=RouterConfig.grammar_compile_timeout_s,
                        help="structured outputs: a spec (JSON schema, regex, grammar) that takes longer to "
                             "compile is refused with INVALID_ARGUMENT / 400")
    security.add_arguments(parser)  # --api-key, TLS, --max-request-bytes, the internal token
    parser.add_argument("--drain-timeout-s", type=_drain_timeout, default=DRAIN_TIMEOUT_S,
                        help="on SIGTERM: new requests are refused (UNAVAILABLE / 503) and those in flight "
                             "get this long to finish; any still running then end with an error. Match the "
                             "decode workers' --drain-timeout-s, or the router cuts answers they would finish")
    add_discovery_arguments(parser)


# The groups below are also `pdserve up`'s, which passes them on to the router: it declares
# them through these functions, under a heading of their own in its --help.

def add_api_arguments(parser: argparse.ArgumentParser) -> None:
    """What the APIs serve: the model's names, its chat template, vLLM's tool and reasoning parsers."""
    parser.add_argument("--served-model-name", nargs="+", default=list(RouterConfig.served_model_names),
                        metavar="NAME", help="the name(s) clients use: /v1/models lists them, a request's `model` "
                                             "must be one, responses report the first (default: --model)")
    parser.add_argument("--chat-template", default=RouterConfig.chat_template, metavar="FILE",
                        help="a Jinja chat template file (or the template itself) in place of the tokenizer's, "
                             "for /v1/chat/completions")
    add_output_parser_arguments(parser)


def add_output_parser_arguments(parser: argparse.ArgumentParser) -> None:
    """vLLM's flags for tool calling and reasoning."""
    parser.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=HttpConfig.tool_call_parser,
                        help="the model's tool-call format, read out of chat outputs for tool_choice \"auto\" "
                             "(with --enable-auto-tool-choice)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true", default=HttpConfig.enable_auto_tool_choice,
                        help="tool_choice \"auto\" (the default when a request gives tools) parses the output with "
                             "--tool-call-parser; without it such a request is refused (400)")
    parser.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=HttpConfig.reasoning_parser,
                        help="chat outputs' <think>...</think> go to reasoning_content")


def add_port_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, default=RouterConfig.port, help="the gRPC API's port")
    parser.add_argument("--http-port", type=port_or_off, default=HttpConfig.port,
                        help="OpenAI-compatible HTTP API port, on --host ('off': gRPC only)")


def add_path_arguments(parser: argparse.ArgumentParser) -> None:
    """How each request's path is chosen (the adaptive policy's own knobs are the router's alone)."""
    parser.add_argument("--path-policy", choices=PATH_POLICIES, default=PathConfig.policy,
                        help="how each request's path is chosen: 'adaptive' from the workers' measured "
                             "rates and load, 'threshold' by --short-prompt-tokens, 'colocated' always direct")
    parser.add_argument("--short-prompt-tokens", type=int, default=RouterConfig.short_prompt_tokens,
                        help="the threshold policy: prompts of at most this many tokens go straight to a decode worker")


def port_or_off(value: str) -> int | None:
    """A port, or None for 'off' (`pdserve up --http-port` parses the same way)."""
    return None if value.lower() in ("off", "none") else _port_or_off(value)


def config_from_args(args) -> RouterConfig:
    prefill, decode = parse_addresses(args.prefill), parse_addresses(args.decode)
    if args.discovery == "static" and not decode:
        raise ValueError("--decode: the router needs at least one decode worker "
                         "(without --prefill, they prefill every prompt themselves: colocated)")
    slo_classes = load_slo_classes(args.slo_config) if args.slo_config else default_slo_classes()
    default_class = DEFAULT_SLO_CLASS if DEFAULT_SLO_CLASS in slo_classes else min(
        slo_classes, key=lambda name: slo_classes[name].priority)
    return RouterConfig(
        model=args.model, revision=args.revision, served_model_names=tuple(args.served_model_name),
        chat_template=args.chat_template, prefill_addresses=prefill, decode_addresses=decode,
        kvstore_address=args.kvstore,
        paths=PathConfig(policy=args.path_policy, min_direct_chunk_tokens=args.min_direct_chunk_tokens,
                         rescue_step_ms=args.rescue_step_ms),
        short_prompt_tokens=args.short_prompt_tokens, slo_classes=slo_classes, default_slo_class=default_class,
        max_model_len=args.max_model_len, host=args.host, port=args.port, metrics_port=args.metrics_port,
        poll_interval_s=args.poll_interval_s, retry_after_ms=args.retry_after_ms, placement=args.placement,
        kv_store_weight=args.kv_store_weight, kv_host_weight=args.kv_host_weight,
        public=security.public_security_from_args(args),
        internal=internal_client_security(args), max_request_bytes=args.max_request_bytes,
        grammar_compile_timeout_s=args.grammar_compile_timeout_s,
        saturation=SaturationConfig(max_waiting=args.max_worker_waiting,
                                    max_in_flight_per_worker=args.max_in_flight_per_worker))


def http_config_from_args(args) -> HttpConfig | None:
    if args.http_port is None:
        return None
    return HttpConfig(host=args.host, port=args.http_port, api_key=security.api_key_from_args(args),
                      tls=server_tls_from_args(args), max_request_bytes=args.max_request_bytes,
                      tool_call_parser=args.tool_call_parser, enable_auto_tool_choice=args.enable_auto_tool_choice,
                      reasoning_parser=args.reasoning_parser)


def run(args) -> int:
    configure_logging("router")
    cfg = config_from_args(args)
    http = http_config_from_args(args)
    discovery = discovery_from_args(args)  # None: the static --prefill/--decode lists
    if discovery is not None and not discovery.start(wait_s=10.0):
        logger.warning("no EndpointSlice list yet; the pools fill in when the API server answers")
    from pdserve.services.router.server import serve  # after the arguments are known good: loads the tokenizer
    running = serve(cfg, discovery=discovery, http=http)
    metrics = f", metrics on :{running.metrics_port}" if running.metrics_port is not None else ""
    print(f"router serving on {cfg.host}:{running.server.port}{metrics}", flush=True)
    if running.http_port is not None:
        scheme = "https" if http.tls is not None else "http"
        print(f"OpenAI-compatible API on {scheme}://{cfg.host}:{running.http_port}/v1", flush=True)
    wait_for_shutdown()
    logger.info("draining (up to %g s), then stopping", args.drain_timeout_s)
    running.stop(grace_s=args.drain_timeout_s)
    if discovery is not None:
        discovery.stop()
    return 0
