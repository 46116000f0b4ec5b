"""The chart's credentials and TLS (docs/security.md): the API key reaches the router (and
`helm test`), the internal token every worker and the kvstore, TLS Secrets are mounted
where the flags point, and probes move to the plaintext health port of a TLS server. The
command lines go through the real `pdserve` parser and security builders."""
from __future__ import annotations

from pdserve.cli.main import build_parser
from pdserve.services.common.security import internal_client_security, internal_server_security
from pdserve.services.router.security import public_security_from_args
from tests.deploy.chart import COMPONENTS, FULLNAME, container, render, render_error

CLI = build_parser()
SECURED = ("auth.apiKey.value=key-1", "auth.internalToken.existingSecret=my-token",
           "tls.router.secretName=router-tls", "tls.internal.secretName=internal-tls")


def _container(m, component: str) -> dict:
    return container(m.get("Deployment", f"{FULLNAME}-{component}"))


def _secret_env(c: dict) -> dict[str, tuple[str, str]]:
    return {e["name"]: (e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])
            for e in c.get("env", []) if "valueFrom" in e}


def _mounts(c: dict) -> dict[str, str]:
    return {v["name"]: v["mountPath"] for v in c.get("volumeMounts", [])}


def test_by_default_no_credentials_and_probes_on_the_grpc_port():
    m = render()
    assert not m.of_kind("Secret")
    for component in COMPONENTS:
        c = _container(m, component)
        assert not any(a.startswith(("--tls", "--internal-", "--health-port")) for a in c["args"])
        assert "PDSERVE_INTERNAL_TOKEN" not in _secret_env(c)
        assert c["readinessProbe"]["grpc"]["port"] == next(p["containerPort"] for p in c["ports"]
                                                           if p["name"] == "grpc")


def test_secured_values_reach_every_pod_as_env_flags_and_mounts():
    m = render(sets=SECURED)
    (secret,) = m.of_kind("Secret")  # only the value given inline; the token's Secret is the user's
    assert secret["metadata"]["name"] == f"{FULLNAME}-api-key" and secret["stringData"] == {"api-key": "key-1"}
    for component in COMPONENTS:
        c = _container(m, component)
        env = _secret_env(c)
        assert env["PDSERVE_INTERNAL_TOKEN"] == ("my-token", "token")
        assert ("PDSERVE_API_KEY" in env) == (component == "router")
        assert _mounts(c)["tls-internal"] == "/var/run/pdserve/tls/internal"
        for probe in ("startupProbe", "readinessProbe"):
            assert c[probe]["grpc"]["port"] == 9091
        args = CLI.parse_args(c["args"])
        assert args.health_port == 9091 and args.tls_cert_file.endswith("/tls.crt")
        if component == "router":
            assert _mounts(c)["tls-router"] == "/var/run/pdserve/tls/router"
            assert args.tls_cert_file.startswith("/var/run/pdserve/tls/router/") and args.tls_client_ca_file is None
        else:  # the internal ports require the client certificate of a release pod
            assert args.tls_client_ca_file == "/var/run/pdserve/tls/internal/ca.crt"
        if component != "kvstore":  # the kvstore calls no one
            assert args.internal_tls_ca_file == "/var/run/pdserve/tls/internal/ca.crt"
            assert args.internal_tls_server_name == "pdserve-internal"


def test_the_flags_the_chart_writes_build_a_secured_config(tmp_path, monkeypatch):
    """The secured router's and a worker's args, with the Secrets' files and env as the pod has them."""
    from tests.services.security.certs import make_certs
    certs = make_certs(tmp_path)
    m = render(sets=SECURED)
    monkeypatch.setenv("PDSERVE_INTERNAL_TOKEN", "t1,t0")
    monkeypatch.setenv("PDSERVE_API_KEY", "key-1")

    def local(args: list[str]) -> list[str]:  # the mounted Secrets' files (ca.crt, tls.crt, tls.key), here
        return [a.replace("/var/run/pdserve/tls/router/", f"{tmp_path}/")
                 .replace("/var/run/pdserve/tls/internal/", f"{tmp_path}/") for a in args]
    router = CLI.parse_args(local(_container(m, "router")["args"]))
    public = public_security_from_args(router)
    assert public.tokens == ("key-1",) and public.tls is not None and public.health_port == 9091
    assert internal_client_security(router).token == "t1"
    decode = CLI.parse_args(local(_container(m, "decode")["args"]))
    served = internal_server_security(decode)
    assert served.tokens == ("t1", "t0") and served.tls.client_ca_file == certs.ca


def test_the_helm_test_pod_sends_the_api_key_and_trusts_the_router_ca():
    (pod,) = render(sets=SECURED).of_kind("Pod")
    (c,) = pod["spec"]["containers"]
    assert _secret_env(c)["PDSERVE_API_KEY"] == (f"{FULLNAME}-api-key", "api-key")
    assert "PDSERVE_INTERNAL_TOKEN" not in _secret_env(c)
    assert {e["name"]: e.get("value") for e in c["env"]}["PDSERVE_TLS_CA_FILE"] == "/var/run/pdserve/tls/router/ca.crt"


def test_an_internal_token_value_gets_a_secret_of_the_chart():
    m = render(sets=("auth.internalToken.value=abc",))
    (secret,) = m.of_kind("Secret")
    assert secret["metadata"]["name"] == f"{FULLNAME}-internal-token" and secret["stringData"] == {"token": "abc"}
    assert _secret_env(_container(m, "kvstore"))["PDSERVE_INTERNAL_TOKEN"] == (f"{FULLNAME}-internal-token", "token")


def test_a_misspelled_security_value_is_refused():
    assert "tokn" in render_error("auth.internalToken.tokn=x")
    assert "healthPort" in render_error("tls.healthPort=0")
