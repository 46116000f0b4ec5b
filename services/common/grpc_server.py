"""A gRPC server with what every pdserve service serves besides its own API: the standard
health service (so Kubernetes probes and `grpc_health_probe` work) and server reflection
(so `grpcurl` works without .proto files); and what it asks of its callers (a bearer
token, TLS: services/common/security.py), the same way for every port."""
from __future__ import annotations

from concurrent import futures
from dataclasses import dataclass
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve.services.common.auth import BearerAuthInterceptor, BearerTokenSender
from pdserve.services.common.security import ClientSecurity, ServerSecurity, warn_if_open

# The largest message an internal port takes or sends. The largest legitimate ones carry
# KV bytes: a GetBlocks KVBlockBatch of about batch_codec.BATCH_BYTES (16 MiB) plus the
# block that crossed it (a 405B-class model's block is ~8 MiB in bf16), a one-block Put,
# and a KVEvents snapshot (~34 bytes per held block hash: a kvstore holding millions of
# blocks sends tens of MiB at once). 256 MiB covers them all with room; the router's public
# port takes far less (its limit follows max_model_len: services/router/security.py).
INTERNAL_MAX_MESSAGE_BYTES = 256 * 1024 * 1024


@dataclass
class ServiceSpec:
    name: str                         # full name, e.g. "pdserve.v1.KVStore"
    register: Callable[[object, grpc.Server], None]  # the generated add_*Servicer_to_server
    servicer: object


@dataclass
class RunningServer:
    server: grpc.Server
    port: int
    health: health.HealthServicer
    service_names: list[str]
    health_server: grpc.Server | None = None  # the plaintext health-only port, beside a TLS one
    health_port: int | None = None

    def set_serving(self, serving: bool) -> None:
        """Draining sets NOT_SERVING: probes fail, routers stop sending new work."""
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ["", *self.service_names]:
            self.health.set(name, status)

    def stop(self, grace: float | None = 5.0) -> None:
        self.set_serving(False)
        self.server.stop(grace).wait()
        if self.health_server is not None:
            self.health_server.stop(0).wait()


def grpc_options(max_receive_bytes: int = INTERNAL_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [("grpc.max_send_message_length", INTERNAL_MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", max_receive_bytes)]


def start_server(specs: list[ServiceSpec], host: str = "127.0.0.1", port: int = 0,
                 max_workers: int = 32, serving: bool = True, security: ServerSecurity = ServerSecurity(),
                 max_receive_bytes: int = INTERNAL_MAX_MESSAGE_BYTES) -> RunningServer:
    """Start serving `specs` on host:port (port 0 picks a free one); returns the bound port.
    `serving`: the health service's first status (a router that is not ready yet says so at once).
    `security`: callers need one of its tokens (all but the health service) and, with its
    TLS, a TLS connection. `max_receive_bytes`: a larger request is refused, unread
    (RESOURCE_EXHAUSTED)."""
    interceptors = [BearerAuthInterceptor(security.tokens, security.credential)] if security.tokens else []
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), interceptors=interceptors,
                         options=grpc_options(max_receive_bytes))
    for spec in specs:
        spec.register(spec.servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [s.name for s in specs]
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    if security.tls is not None:
        bound = server.add_secure_port(f"{host}:{port}", security.tls.credentials())
    else:
        bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    warn_if_open(security, f"gRPC port {host}:{bound} ({', '.join(names)})")
    running = RunningServer(server, bound, health_servicer, names)
    if security.health_port is not None:
        running.health_server, running.health_port = _health_only(health_servicer, host, security.health_port)
    running.set_serving(serving)  # before the first call can ask
    server.start()
    return running


def _health_only(servicer: health.HealthServicer, host: str, port: int) -> tuple[grpc.Server, int]:
    """The health service alone on a plaintext port: Kubernetes' gRPC probes speak no TLS.
    It shares the main server's statuses (one HealthServicer), so draining shows on both."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"health port: cannot listen on {host}:{port}")
    server.start()
    return server, bound


def channel(address: str, extra_options: tuple[tuple[str, int], ...] = (),
            security: ClientSecurity = ClientSecurity()) -> grpc.Channel:
    """A channel to `address` that shows `security` (its token on every call, its TLS)."""
    options = [*grpc_options(), *extra_options]
    if security.tls is not None:
        ch = grpc.secure_channel(address, security.tls.credentials(), options=[*options, *security.tls.options()])
    else:
        ch = grpc.insecure_channel(address, options=options)
    return grpc.intercept_channel(ch, BearerTokenSender(security.token)) if security.token else ch


def is_serving(address: str, timeout: float = 1.0, security: ClientSecurity = ClientSecurity()) -> bool:
    try:
        with channel(address, security=security) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
            return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False
