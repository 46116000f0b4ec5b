"""TLS for gRPC ports and channels: PEM files in, grpc credentials out.

A server with a client CA requires every caller to present a certificate it signed
(mTLS). Internal clients usually dial pod IPs, which no certificate can list in advance:
`server_name` is then the name the servers' certificates are issued for, verified
instead of the dialed host.
"""
from __future__ import annotations

import ssl
from dataclasses import dataclass

import grpc


def read_pem(path: str, name: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ValueError(f"{name}: cannot read {path}: {e.strerror}") from None
    if b"-----BEGIN" not in data:
        raise ValueError(f"{name}: {path} is not a PEM file")
    return data


@dataclass(frozen=True)
class ServerTLS:
    cert_file: str
    key_file: str
    client_ca_file: str | None = None  # set: callers must present a certificate this CA signed

    def __post_init__(self) -> None:
        self.pem()  # a missing or unreadable file fails at start, naming its flag

    def pem(self) -> tuple[bytes, bytes, bytes | None]:
        ca = read_pem(self.client_ca_file, "tls_client_ca_file") if self.client_ca_file else None
        return read_pem(self.cert_file, "tls_cert_file"), read_pem(self.key_file, "tls_key_file"), ca

    def credentials(self) -> grpc.ServerCredentials:
        cert, key, ca = self.pem()  # read at each start: a restart picks up a renewed certificate
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)

    def ssl_context(self) -> ssl.SSLContext:
        """The same certificates for a port served with Python's ssl (the kvstore's TCP port)."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.cert_file, self.key_file)
        if self.client_ca_file:
            context.verify_mode = ssl.CERT_REQUIRED
            context.load_verify_locations(cafile=self.client_ca_file)
        return context


@dataclass(frozen=True)
class ClientTLS:
    ca_file: str | None = None         # None: the system's roots
    cert_file: str | None = None       # with key_file: this client's certificate (for mTLS)
    key_file: str | None = None
    server_name: str | None = None     # verify this name instead of the dialed host

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("tls cert_file and key_file: give both or neither")
        self.credentials()

    def credentials(self) -> grpc.ChannelCredentials:
        ca = read_pem(self.ca_file, "tls ca_file") if self.ca_file else None
        cert = read_pem(self.cert_file, "tls cert_file") if self.cert_file else None
        key = read_pem(self.key_file, "tls key_file") if self.key_file else None
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    def ssl_context(self) -> ssl.SSLContext:
        """The same trust for a connection made with Python's ssl; dial with
        server_hostname=self.server_name or the host."""
        context = ssl.create_default_context(cafile=self.ca_file)
        if self.cert_file:
            context.load_cert_chain(self.cert_file, self.key_file)
        return context

    def options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []
