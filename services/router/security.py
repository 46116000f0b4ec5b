"""The router's side of docs/security.md: what its public ports ask of clients (the API
key, TLS, a request size bound) and how it calls the internal ports (the internal token,
TLS). `pdserve router` builds them from its flags; serve() applies them."""
from __future__ import annotations

import argparse
import os

from pdserve.services.common.auth import parse_tokens
from pdserve.services.common.numbers import number_arg
from pdserve.services.common.security import (API_KEY, ServerSecurity, add_internal_client_arguments,
                                              add_internal_token_argument, add_server_tls_arguments, server_tls_from_args)
from pdserve.services.router.config import BYTES_PER_TOKEN, REQUEST_SLACK_BYTES
from pdserve.services.router.fronts.http.config import API_KEY_ENV

_positive_bytes = number_arg(int, "a number of bytes", low=0, low_open=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--api-key", default=None,
                        help=f"require 'authorization: Bearer KEY' on the gRPC and HTTP APIs "
                             f"(default: ${API_KEY_ENV}; comma-separated: any of them)")
    add_server_tls_arguments(parser, "the public gRPC and HTTP ports")
    parser.add_argument("--max-request-bytes", type=_positive_bytes, default=None,
                        help=f"the largest request accepted, a gRPC message or an HTTP body (default: {BYTES_PER_TOKEN} bytes per token "
                             f"of max_model_len + {REQUEST_SLACK_BYTES >> 20} MiB)")
    add_internal_token_argument(parser)
    add_internal_client_arguments(parser)


def api_key_from_args(args) -> str | None:
    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    if key is not None and not key.strip():
        raise ValueError(f"--api-key: must not be empty (unset ${API_KEY_ENV} to disable the check)")
    parse_tokens(key, "--api-key")  # a malformed list fails here, naming the flag
    return key.strip() if key else None


def public_security_from_args(args) -> ServerSecurity:
    """The public gRPC port's: the API key(s) and TLS (the HTTP API takes the same)."""
    return ServerSecurity(parse_tokens(api_key_from_args(args), "--api-key"), API_KEY, server_tls_from_args(args),
                          args.health_port)

