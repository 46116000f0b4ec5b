"""A gRPC server with what every pdserve service serves besides its own API: the standard
health service (so Kubernetes probes and `grpc_health_probe` work) and server reflection
(so `grpcurl` works without .proto files)."""
from __future__ import annotations

from concurrent import futures
from dataclasses import dataclass
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

MAX_MESSAGE_BYTES = 256 * 1024 * 1024  # KV blocks travel in batches


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

    def set_serving(self, serving: bool) -> None:
        """Draining sets NOT_SERVING: probes fail, routers stop sending new work."""
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ["", *self.service_names]:
            self.health.set(name, status)

    def stop(self, grace: float | None = 5.0) -> None:
        self.set_serving(False)
        self.server.stop(grace).wait()


def grpc_options() -> list[tuple[str, int]]:
    return [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]


def start_server(specs: list[ServiceSpec], host: str = "127.0.0.1", port: int = 0,
                 max_workers: int = 32, serving: bool = True) -> RunningServer:
    """Start serving `specs` on host:port (port 0 picks a free one); returns the bound port.
    `serving`: the health service's first status (a router that is not ready yet says so at once)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=grpc_options())
    for spec in specs:
        spec.register(spec.servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [s.name for s in specs]
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    running = RunningServer(server, bound, health_servicer, names)
    running.set_serving(serving)  # before the first call can ask
    server.start()
    return running


def channel(address: str, extra_options: tuple[tuple[str, int], ...] = ()) -> grpc.Channel:
    return grpc.insecure_channel(address, options=[*grpc_options(), *extra_options])


def is_serving(address: str, timeout: float = 1.0) -> bool:
    try:
        with channel(address) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
            return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False
