"""The pods the chart runs: their command lines are what `pdserve` accepts, ports and
probes are where the services listen, every container is locked down, workers drain."""
from __future__ import annotations

import json

import pytest

from pdserve.cli.main import build_parser
from pdserve.services.router.config import load_slo_classes
from tests.deploy import gflags
from tests.deploy.chart import (COMPONENTS, FULLNAME, VALUES, container, expand_env, port_number, render,
                                values)

ALL = list(VALUES)
CLI = build_parser()


def parse(c: dict):
    """The container's command line through the real `pdserve` parser (the image's entrypoint)."""
    try:
        return CLI.parse_args(expand_env(c["args"], c.get("env", [])))
    except SystemExit as e:
        pytest.fail(f"pdserve rejects the {c['name']} container's args {c['args']} (exit {e.code})")


def deployment(m, component: str) -> dict:
    return m.get("Deployment", f"{FULLNAME}-{component}")


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("component", COMPONENTS)
def test_command_lines_are_accepted_by_pdserve(name, component):
    c = container(deployment(render(name), component))
    args = parse(c)
    assert args.command == component
    assert args.host == "0.0.0.0"  # a pod serves on its pod IP, not loopback


@pytest.mark.parametrize("name", ALL)
def test_every_container_is_accepted_by_its_program(name):
    """Every container the release can run, whatever its program: pdserve's through its
    parser, Mooncake's (kvstore.backend.type=mooncake) through the flags the installed
    binary declares (tests/deploy/gflags.py). Only Redis's own image is not checked here."""
    for pod_name, _, spec in render(name).pod_specs():
        for c in spec["containers"]:
            if "command" in c:
                assert c["command"][0] in gflags.MOONCAKE_PROGRAMS, (pod_name, c["name"], c["command"])
                gflags.parse(c["command"][0], expand_env(c["args"], c.get("env", [])))
            elif c["args"][0] != "redis-server":  # the pdserve image's entrypoint
                parse(c)


@pytest.mark.parametrize("name", ALL)
def test_the_helm_test_pod_runs_a_valid_generate(name):
    (pod,) = render(name).of_kind("Pod")
    args = parse(pod["spec"]["containers"][0])
    assert args.command == "generate" and args.url == f"{FULLNAME}-router:{values(name)['router']['port']}"


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("component", COMPONENTS)
def test_ports_and_probes_are_where_the_service_listens(name, component):
    m = render(name)
    c = container(deployment(m, component))
    args = parse(c)
    assert port_number(c, "grpc") == args.port == values(name)[component]["port"]
    assert port_number(c, "metrics") == args.metrics_port
    # readiness and startup ask the gRPC health service on the serving port
    assert c["readinessProbe"]["grpc"] == {"port": args.port}
    assert c["startupProbe"]["grpc"] == {"port": args.port}
    # liveness does not ask health: a draining worker answers NOT_SERVING and must not be killed for it
    assert c["livenessProbe"] == {**c["livenessProbe"], "tcpSocket": {"port": "grpc"}}
    service = m.get("Service", f"{FULLNAME}-{component}")
    named = {p["name"]: p for p in c["ports"]}
    for sp in service["spec"]["ports"]:
        assert sp["targetPort"] in named, f"{component} Service targets a port the pod lacks: {sp}"
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]}["grpc"] == args.port
    pod_labels = deployment(m, component)["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()


@pytest.mark.parametrize("name", ALL)
def test_everyone_finds_the_kvstore_and_the_router_finds_the_workers(name):
    m = render(name)
    kv_service = m.get("Service", f"{FULLNAME}-kvstore")
    kv_address = f"{FULLNAME}-kvstore:{kv_service['spec']['ports'][0]['port']}"
    for component in ("router", "prefill", "decode"):
        assert parse(container(deployment(m, component))).kvstore == kv_address
    router = parse(container(deployment(m, "router")))
    assert router.namespace == "llm"
    for pool, selector in (("prefill", router.prefill_selector), ("decode", router.decode_selector)):
        service = m.get("Service", f"{FULLNAME}-{pool}")
        # EndpointSlices carry their Service's name in this label, and its port names
        assert selector == f"kubernetes.io/service-name={service['metadata']['name']}"
        assert router.discovery_port_name in {p["name"] for p in service["spec"]["ports"]}
        assert service["spec"]["clusterIP"] == "None"  # headless: the router talks to each pod


@pytest.mark.parametrize("name", ALL)
def test_the_router_has_exactly_the_rbac_discovery_needs(name):
    m = render(name)
    (role,) = m.of_kind("Role")
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["get", "list", "watch"]}]
    (binding,) = m.of_kind("RoleBinding")
    router_pod = deployment(m, "router")["spec"]["template"]["spec"]
    assert binding["subjects"][0]["name"] == router_pod["serviceAccountName"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    for pod_name, _, spec in m.pod_specs():  # no other pod gets an API token
        assert spec["automountServiceAccountToken"] is (pod_name == f"{FULLNAME}-router")


@pytest.mark.parametrize("name", ALL)
def test_the_router_reads_the_slo_classes_of_the_values(name, tmp_path):
    m = render(name)
    router = deployment(m, "router")
    args = parse(container(router))
    mount = next(v for v in container(router)["volumeMounts"] if args.slo_config.startswith(v["mountPath"] + "/"))
    volume = next(v for v in router["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    config_map = m.get("ConfigMap", volume["configMap"]["name"])
    path = tmp_path / "slo.json"
    path.write_text(config_map["data"][args.slo_config.rsplit("/", 1)[1]])
    classes = load_slo_classes(str(path))  # the router's own loader
    assert {n: c.ttft_ms for n, c in classes.items()} == {
        n: c["ttft_ms"] for n, c in values(name)["router"]["sloClasses"].items()}
    assert json.loads(path.read_text()) == values(name)["router"]["sloClasses"]


@pytest.mark.parametrize("name", ALL)
def test_every_container_runs_as_non_root_on_a_read_only_root(name):
    for pod_name, _, spec in render(name).pod_specs():
        pod_ctx = spec.get("securityContext", {})
        assert pod_ctx.get("seccompProfile") == {"type": "RuntimeDefault"}, pod_name
        for c in spec["containers"]:
            ctx = {**pod_ctx, **c.get("securityContext", {})}
            assert ctx["runAsNonRoot"] is True, (pod_name, c["name"])
            assert ctx["runAsUser"] > 0, (pod_name, c["name"])
            assert ctx["readOnlyRootFilesystem"] is True, (pod_name, c["name"])
            assert ctx["allowPrivilegeEscalation"] is False, (pod_name, c["name"])
            assert ctx["capabilities"] == {"drop": ["ALL"]}, (pod_name, c["name"])
            assert not ctx.get("privileged"), (pod_name, c["name"])
            # what a read-only root leaves writable: emptyDirs (and the Redis volume)
            writable = {m["mountPath"] for m in c.get("volumeMounts", []) if not m.get("readOnly")}
            assert writable & {"/tmp", "/data"}, (pod_name, c["name"])


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("pool", ["router", "prefill", "decode"])
def test_router_and_workers_drain_before_they_stop(name, pool):
    v = values(name)[pool]
    spec = deployment(render(name), pool)["spec"]["template"]["spec"]
    c = spec["containers"][0]
    assert c["lifecycle"]["preStop"] == {"sleep": {"seconds": v["preStopSleepSeconds"]}}
    # the pause, then SIGTERM: the process goes NOT_SERVING (readiness fails) and finishes its
    # work within its --drain-timeout-s, the pool's one value; the grace period covers both
    assert parse(c).drain_timeout_s == v["drainTimeoutSeconds"]
    assert spec["terminationGracePeriodSeconds"] > v["preStopSleepSeconds"] + v["drainTimeoutSeconds"]


@pytest.mark.parametrize("name", ALL)
def test_the_router_drains_as_long_as_the_decode_workers(name):
    """A router that stopped sooner would cut streams its decode workers still finish."""
    m = render(name)
    router, decode = (parse(container(deployment(m, pool))) for pool in ("router", "decode"))
    assert router.drain_timeout_s >= decode.drain_timeout_s


def test_drain_values_reach_the_processes():
    m = render("default", sets=("decode.drainTimeoutSeconds=200", "router.drainTimeoutSeconds=250",
                                "prefill.drainTimeoutSeconds=7", "kvstore.leaseTtlMs=4321"))
    grace = {pool: deployment(m, pool)["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
             for pool in ("router", "prefill", "decode")}
    assert grace == {"router": 5 + 250 + 10, "prefill": 5 + 7 + 10, "decode": 5 + 200 + 10}
    assert parse(container(deployment(m, "prefill"))).drain_timeout_s == 7
    # the lease TTL is the kvstore's, and the workers ask for the kvstore's (ttl 0)
    assert parse(container(deployment(m, "kvstore"))).lease_ttl_ms == 4321


@pytest.mark.parametrize("component", COMPONENTS)
def test_every_component_has_a_disruption_budget_over_its_pods(component):
    for name in ALL:
        m = render(name)
        pdb = m.get("PodDisruptionBudget", f"{FULLNAME}-{component}")
        labels = deployment(m, component)["spec"]["template"]["metadata"]["labels"]
        assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert pdb["spec"]["maxUnavailable"] == values(name)[component]["pdb"]["maxUnavailable"]


def test_gpu_pools_ask_for_gpus_and_run_the_cuda_engine():
    m = render("default")
    for pool in ("prefill", "decode"):
        c = container(deployment(m, pool))
        args = parse(c)
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert (args.device, args.dtype, args.attention_backend) == ("cuda", "bfloat16", "triton")
        assert c["image"] == "pdserve:0.1.0-cuda"
        tolerations = deployment(m, pool)["spec"]["template"]["spec"]["tolerations"]
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tolerations
    for component in ("router", "kvstore"):  # no GPU, the small image
        c = container(deployment(m, component))
        assert "nvidia.com/gpu" not in c["resources"].get("limits", {})
        assert c["image"] == "pdserve:0.1.0-cpu"


def test_the_cpu_values_run_without_any_gpu():
    m = render("cpu")
    assert "nvidia.com/gpu" not in json.dumps(m.docs)
    for component in COMPONENTS:
        assert container(deployment(m, component))["image"] == "pdserve:0.1.0-cpu"
    for pool in ("prefill", "decode"):
        args = parse(container(deployment(m, pool)))
        assert (args.device, args.dtype, args.attention_backend) == ("cpu", "float32", "torch")


def test_the_large_values_mount_the_model_and_pull_from_the_registry():
    m = render("large")
    for component in ("router", "prefill", "decode"):
        d = deployment(m, component)
        c = container(d)
        assert parse(c).model == "/models/Llama-3.1-8B-Instruct"
        assert {"name": "model", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]
        volumes = {v["name"]: v for v in d["spec"]["template"]["spec"]["volumes"]}
        assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "llama-weights", "readOnly": True}
        assert d["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
        assert c["image"].startswith("registry.example.com/ml/pdserve:0.1.0-")
    prefill = parse(container(deployment(m, "prefill")))
    assert (prefill.max_num_batched_tokens, prefill.max_num_seqs, prefill.max_model_len) == (16384, 256, 32768)


@pytest.mark.parametrize("name,backend", [("default", "memory"), ("cpu", "memory"),
                                          ("redis", f"redis://{FULLNAME}-redis:6379/0")])
def test_the_kvstore_backend(name, backend):
    assert parse(container(deployment(render(name), "kvstore"))).backend == backend


@pytest.mark.parametrize("name,secret", [("redis-external", "kv-redis"), ("large", f"{FULLNAME}-kvstore-redis")])
def test_a_redis_url_of_your_own_comes_from_a_secret(name, secret):
    m = render(name)
    c = container(deployment(m, "kvstore"))
    assert "--backend=$(PDSERVE_REDIS_URL)" in c["args"]
    (env,) = [e for e in c["env"] if e["name"] == "PDSERVE_REDIS_URL"]
    assert env["valueFrom"]["secretKeyRef"]["name"] == secret
    if name == "large":
        assert m.get("Secret", secret)["stringData"]["url"] == "redis://kv-redis.cache.svc:6379/0"
    assert not m.of_kind("StatefulSet")  # no in-chart Redis beside your own


def test_the_in_chart_redis_is_sized_from_the_kvstore_capacity():
    m = render("redis")
    (sts,) = m.of_kind("StatefulSet")
    args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
    capacity_gib = values("redis")["kvstore"]["capacityGiB"]
    maxmemory_mib = int(args[args.index("--maxmemory") + 1].removesuffix("mb"))
    assert maxmemory_mib * 2**20 > capacity_gib * 2**30  # room for the blocks and Redis's overhead
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    assert sts["spec"]["serviceName"] == f"{FULLNAME}-redis"
    assert m.get("Deployment", f"{FULLNAME}-kvstore")["spec"]["replicas"] == 2
