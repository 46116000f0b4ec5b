"""What a gRPC server asks of its callers (ServerSecurity) and what a client shows
(ClientSecurity), and the flags every service builds them from (docs/security.md).

    flag                                 who           what
    --internal-token-file PATH           all           the internal token(s); else $PDSERVE_INTERNAL_TOKEN
    --tls-cert-file/--tls-key-file       servers       serve TLS (router: its public ports)
    --tls-client-ca-file                 servers       also require client certificates (mTLS)
    --health-port PORT                   servers       the health service alone, plaintext (for probes)
    --internal-tls-ca-file               clients       dial internal ports over TLS, verified by this CA
    --internal-tls-cert-file/-key-file   clients       this process's client certificate (mTLS)
    --internal-tls-server-name           clients       the name internal certificates are issued for
"""
from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, field

from pdserve.services.common.auth import INTERNAL_TOKEN_ENV, internal_token, parse_tokens
from pdserve.services.common.tls import ClientTLS, ServerTLS

logger = logging.getLogger(__name__)

INTERNAL_TOKEN = "internal token"
API_KEY = "API key"


@dataclass(frozen=True)
class ServerSecurity:
    tokens: tuple[str, ...] = field(default=(), repr=False)  # any of them is accepted; (): any caller
    credential: str = INTERNAL_TOKEN  # what the tokens are called in errors and logs
    tls: ServerTLS | None = None
    health_port: int | None = None  # also serve the health service alone, plaintext, here (probes)

    def __post_init__(self) -> None:
        if any(not t for t in self.tokens):
            raise ValueError(f"tokens: an empty {self.credential} would accept anyone")


@dataclass(frozen=True)
class ClientSecurity:
    token: str | None = field(default=None, repr=False)  # sent as `authorization: Bearer <token>`
    tls: ClientTLS | None = None  # None: plaintext


def add_internal_token_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--internal-token-file", default=None, metavar="PATH",
                        help=f"the internal token: required of callers, sent to the kvstore/workers "
                             f"(default: ${INTERNAL_TOKEN_ENV}; comma-separated: several accepted, "
                             f"the first sent)")


def add_server_tls_arguments(parser: argparse.ArgumentParser, ports: str) -> None:
    parser.add_argument("--tls-cert-file", default=None, metavar="PEM", help=f"serve TLS on {ports}")
    parser.add_argument("--tls-key-file", default=None, metavar="PEM", help="the --tls-cert-file's private key")
    parser.add_argument("--tls-client-ca-file", default=None, metavar="PEM",
                        help="require client certificates signed by this CA (mTLS)")
    parser.add_argument("--health-port", type=int, default=None, metavar="PORT",
                        help="also serve the gRPC health service alone, in plaintext, on this port "
                             "(Kubernetes' gRPC probes cannot speak TLS)")


def add_internal_client_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--internal-tls-ca-file", default=None, metavar="PEM",
                        help="call workers and the kvstore over TLS, verified against this CA")
    parser.add_argument("--internal-tls-cert-file", default=None, metavar="PEM",
                        help="this process's client certificate, for internal ports that require one")
    parser.add_argument("--internal-tls-key-file", default=None, metavar="PEM")
    parser.add_argument("--internal-tls-server-name", default=None, metavar="NAME",
                        help="verify internal servers' certificates for this name, not the dialed address "
                             "(pods are dialed by IP)")


def server_tls_from_args(args) -> ServerTLS | None:
    if args.tls_cert_file is None and args.tls_key_file is None:
        if args.tls_client_ca_file is not None:
            raise ValueError("--tls-client-ca-file: needs --tls-cert-file and --tls-key-file (mTLS is TLS)")
        return None
    if args.tls_cert_file is None or args.tls_key_file is None:
        raise ValueError("--tls-cert-file and --tls-key-file: give both or neither")
    return ServerTLS(args.tls_cert_file, args.tls_key_file, args.tls_client_ca_file)


def internal_tokens_from_args(args) -> tuple[str, ...]:
    return parse_tokens(internal_token(args.internal_token_file), "--internal-token-file")


def internal_server_security(args) -> ServerSecurity:
    """A worker's or the kvstore's port."""
    return ServerSecurity(internal_tokens_from_args(args), INTERNAL_TOKEN, server_tls_from_args(args),
                          args.health_port)


def internal_client_security(args) -> ClientSecurity:
    """How the router and the workers call internal ports."""
    tokens = internal_tokens_from_args(args)
    tls = None
    if args.internal_tls_ca_file or args.internal_tls_cert_file or args.internal_tls_key_file:
        if (args.internal_tls_cert_file is None) != (args.internal_tls_key_file is None):
            raise ValueError("--internal-tls-cert-file and --internal-tls-key-file: give both or neither")
        tls = ClientTLS(args.internal_tls_ca_file, args.internal_tls_cert_file, args.internal_tls_key_file,
                        args.internal_tls_server_name)
    return ClientSecurity(tokens[0] if tokens else None, tls)


def warn_if_open(security: ServerSecurity, what: str) -> None:
    """Said once at start: a port anyone who reaches it may use (the default, as before)."""
    if not security.tokens:
        logger.warning("%s accepts any caller: no %s is configured (see docs/security.md)",
                       what, security.credential)
