"""Every port of a fully secured platform, as real processes over real sockets: the router
takes the API key over TLS, the workers and the kvstore the internal token over mTLS (and
over TCP and UCX, in their hello). A caller without the credential, or with a wrong one, is refused;
with it, it works; the two keys of a rotation are both accepted.

    router  ── API key, TLS ──────────── clients
      │ internal token, mTLS
    prefill, decode ── internal token, mTLS (gRPC) / hello (UCX) ──▶ kvstore
"""
from __future__ import annotations

import ssl
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import grpc
import pytest

from pdserve.engine import SamplingParams
from pdserve.services.common.grpc_server import channel, is_serving
from pdserve.services.common.security import ClientSecurity
from pdserve.services.common.tls import ClientTLS
from pdserve.services.kvstore.client import KVStoreClient
from pdserve.services.kvstore.errors import KVStoreError
from pdserve.services.pb import common_pb2, decode_pb2_grpc, kv_events_pb2, kv_events_pb2_grpc, kvstore_pb2
from pdserve.services.pb import kvstore_pb2_grpc, prefill_pb2_grpc
from pdserve.services.router.client import RouterClient
from tests.services.security.certs import SERVER_NAME, Certs, make_certs
from tests.services.security.procs import Processes, free_ports

TOKENS = "tok-new,tok-old"   # a rotation in progress: both accepted, tok-new sent
API_KEYS = "key-a,key-b"
MAX_MODEL_LEN = 128          # the router's public request bound follows it (about 1 MiB here)


@dataclass
class Secured:
    certs: Certs
    ports: dict[str, int]

    def address(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    def internal(self, token: str | None, cert: bool = True, ca: str | None = None) -> ClientSecurity:
        certs = self.certs
        tls = ClientTLS(ca or certs.ca, certs.cert if cert else None, certs.key if cert else None, SERVER_NAME)
        return ClientSecurity(token, tls)

    def router(self, api_key: str | None) -> RouterClient:
        return RouterClient(self.address("router"), api_key=api_key, tls=ClientTLS(self.certs.ca))


@pytest.fixture(scope="module")
def secured(tmp_path_factory, tiny_llama_dir):
    tmp = tmp_path_factory.mktemp("secured")
    certs = make_certs(tmp)
    (tmp / "token").write_text(TOKENS + "\n")
    names = ["kvstore", "ucx", "tcp", "prefill", "decode", "router", "http"]
    ports = dict(zip(names + [f"{n}-health" for n in names], free_ports(2 * len(names))))
    serve_tls = ["--tls-cert-file", certs.cert, "--tls-key-file", certs.key]
    internal_server = [*serve_tls, "--tls-client-ca-file", certs.ca, "--internal-token-file", str(tmp / "token")]
    internal_client = ["--internal-tls-ca-file", certs.ca, "--internal-tls-cert-file", certs.cert,
                       "--internal-tls-key-file", certs.key, "--internal-tls-server-name", SERVER_NAME,
                       "--internal-token-file", str(tmp / "token")]
    procs = Processes(tmp)
    secured = Secured(certs, ports)

    def serve(name: str, args: list[str], env: dict | None = None) -> None:
        procs.start(name, [*args, "--host", "127.0.0.1", "--port", str(ports[name]),
                           "--health-port", str(ports[f"{name}-health"])], env)
    try:
        serve("kvstore", ["kvstore", "--ucx-port", str(ports["ucx"]), "--tcp-port", str(ports["tcp"]),
                          *internal_server])
        for role in ("prefill", "decode"):
            serve(role, [role, "--model", tiny_llama_dir, "--kvstore", secured.address("kvstore"),
                         "--kvstore-transport", "ucx", "--kv-cache-memory-bytes", str(8 << 20), "--threads", "1",
                         *internal_server, "--internal-tls-ca-file", certs.ca, "--internal-tls-cert-file",
                         certs.cert, "--internal-tls-key-file", certs.key, "--internal-tls-server-name", SERVER_NAME])
        serve("router", ["router", "--model", tiny_llama_dir, "--prefill", secured.address("prefill"),
                         "--decode", secured.address("decode"), "--kvstore", secured.address("kvstore"),
                         "--http-port", str(ports["http"]), "--path-policy", "threshold",
                         "--short-prompt-tokens", "4", "--max-model-len", str(MAX_MODEL_LEN), *serve_tls,
                         *internal_client], env={"PDSERVE_API_KEY": API_KEYS})
        for name in ("kvstore", "prefill", "decode", "router"):  # the router: ready once it sees both
            procs.wait_serving(name, secured.address(f"{name}-health"), timeout_s=180)
        yield secured
    finally:
        procs.stop()


def _worker_calls(ch: grpc.Channel, name: str):
    """One call of each service on `name`'s port (its own API, KVEvents), for the checks."""
    if name == "kvstore":
        return [lambda: kvstore_pb2_grpc.KVStoreStub(ch).Stats(kvstore_pb2.StatsRequest(), timeout=10)]
    stub = (prefill_pb2_grpc.PrefillWorkerStub if name == "prefill" else decode_pb2_grpc.DecodeWorkerStub)(ch)
    events = kv_events_pb2_grpc.KVEventsStub(ch)
    return [lambda: stub.GetLoad(common_pb2.GetLoadRequest(), timeout=10),
            lambda: next(iter(events.Subscribe(kv_events_pb2.SubscribeKVEventsRequest(), timeout=10)))]


@pytest.mark.parametrize("name", ["prefill", "decode", "kvstore"])
def test_an_internal_port_takes_only_the_internal_token(secured, name):
    for token in (None, "wrong", "tok-new,tok-old"):
        with channel(secured.address(name), security=secured.internal(token)) as ch:
            for call in _worker_calls(ch, name):
                with pytest.raises(grpc.RpcError) as e:
                    call()
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, (token, e.value)
                assert "internal token" in e.value.details()
    for token in ("tok-new", "tok-old"):  # both sides of the rotation
        with channel(secured.address(name), security=secured.internal(token)) as ch:
            for call in _worker_calls(ch, name):
                call()


def test_the_ucx_port_takes_only_the_internal_token(secured):
    def get(token):
        client = KVStoreClient(secured.address("kvstore"), transport="ucx", ucx_address=secured.address("ucx"),
                               timeout_s=10, security=secured.internal(token))
        try:
            return client.get([bytes(32)])
        finally:
            client.close()
    for token in (None, "wrong"):
        with pytest.raises(KVStoreError) as e:
            get(token)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "internal token" in e.value.details()
    assert [b.found for b in get("tok-old")] == [False]


def test_the_tcp_port_takes_only_the_internal_token_over_mtls(secured):
    def get(token, cert=True):
        client = KVStoreClient(secured.address("kvstore"), transport="tcp", tcp_address=secured.address("tcp"),
                               timeout_s=10, security=secured.internal(token, cert))
        try:
            return [found for batch in client.get_blocks([bytes(32)]) for found in batch.message.found]
        finally:
            client.close()
    for token in (None, "wrong"):
        with pytest.raises(KVStoreError) as e:
            get(token)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "internal token" in e.value.details()
    with pytest.raises(KVStoreError) as e:  # mTLS: no client certificate, no connection
        get("tok-new", cert=False)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert get("tok-old") == [False]


def test_the_router_takes_only_the_api_key_and_moves_kv_through_the_secured_store(secured):
    for key in (None, "wrong", "tok-new"):  # the internal token is no API key
        with secured.router(key) as client, pytest.raises(grpc.RpcError) as e:
            client.list_models()
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "API key" in e.value.details()
    with secured.router("key-b") as client:
        assert client.list_models()
    # long prompts: prefill -> kvstore (UCX, gRPC) -> decode. The prefill writes in the
    # background; on a loaded machine a request's lease or write may miss its time (the
    # decode then recomputes, and a write after the lease ended is dropped), so up to three
    # requests, until blocks have come in through the kvstore's checks
    stats = None
    with channel(secured.address("kvstore"), security=secured.internal("tok-new")) as ch:
        for attempt in range(3):
            with secured.router("key-a") as client:
                text, ids, finish, usage = client.generate_text(
                    f"attempt {attempt}: a prompt long enough to need the prefill pool " * 3,
                    SamplingParams(max_tokens=3), timeout_s=60)
            assert finish and len(ids) == 3
            deadline = time.monotonic() + 15
            while (stats := kvstore_pb2_grpc.KVStoreStub(ch).Stats(kvstore_pb2.StatsRequest(),
                                                                   timeout=10)).num_blocks == 0:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            if stats.num_blocks:
                break
    assert stats.num_blocks > 0, f"no block reached the kvstore in three requests: {stats}"


def test_health_stays_open_on_every_port(secured):
    for name in ("kvstore", "prefill", "decode"):
        assert is_serving(secured.address(name), security=secured.internal(None))  # mTLS, no token
        assert is_serving(secured.address(f"{name}-health"))                      # plaintext probe port
    assert is_serving(secured.address("router"), security=ClientSecurity(tls=ClientTLS(secured.certs.ca)))


def test_a_tls_port_refuses_plaintext_and_untrusted_or_anonymous_tls(secured):
    with RouterClient(secured.address("router"), api_key="key-a") as plain, pytest.raises(grpc.RpcError) as e:
        plain.list_models(timeout_s=5)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    refused = [ClientSecurity("tok-new"),                               # plaintext
               secured.internal("tok-new", cert=False),                 # TLS without a client certificate
               secured.internal("tok-new", ca=secured.certs.other_ca)]  # a server it cannot verify
    for security in refused:
        with channel(secured.address("kvstore"), security=security) as ch, pytest.raises(grpc.RpcError) as e:
            kvstore_pb2_grpc.KVStoreStub(ch).Stats(kvstore_pb2.StatsRequest(), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_the_http_api_takes_the_api_key_over_tls_only(secured):
    url = f"https://127.0.0.1:{secured.ports['http']}/v1/models"
    context = ssl.create_default_context(cafile=secured.certs.ca)

    def status(key: str | None) -> int:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        try:
            return urllib.request.urlopen(urllib.request.Request(url, headers=headers), context=context,
                                          timeout=10).status
        except urllib.error.HTTPError as e:
            return e.code
    assert [status(k) for k in (None, "wrong", "key-a", "key-b")] == [401, 401, 200, 200]
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(url.replace("https", "http"), timeout=10)


def test_an_oversized_request_is_refused_before_it_is_read(secured):
    """MAX_MODEL_LEN=128: the bound is 128 x 64 bytes + 1 MiB; 4 MiB of prompt is refused by
    gRPC itself (the router's handler, its tokenizer, never see it)."""
    start = time.monotonic()
    with secured.router("key-a") as client, pytest.raises(grpc.RpcError) as e:
        client.generate_text("x" * (4 << 20), SamplingParams(max_tokens=1), timeout_s=30)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert time.monotonic() - start < 5
