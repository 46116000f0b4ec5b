"""kvstore.backend.type=mooncake: the Mooncake topology the chart renders (one master, the
store nodes, the kvstore as their index, the workers on --kvstore-transport mooncake), every
command line through the real parser of its program (pdserve's argparse, Mooncake's gflags
through the installed binaries), the NetworkPolicy fence around Mooncake's unauthenticated
ports, RDMA settings, and the values refused, by the schema or by _validate.tpl, naming the
value. The rendered master and a store node are also started here, from their rendered
command lines, and must mount the segment and answer the probes' /health."""
from __future__ import annotations

import contextlib
import os
import random
import socket
import subprocess
import sys
import time
import urllib.request

import psutil
import pytest
import yaml

from pdserve.cli.bench.local_platform import free_port_range
from pdserve.cli.mooncake_procs import INDEX_SHARE, MooncakePlan
from pdserve.services.kvstore.main import config_from_args, mooncake_settings
from pdserve.services.kvstore.transports.mooncake.plane import DEFAULT_FAILOVER_S, MASTER_CLIENT_TTL_S, MooncakeSettings
from pdserve.services.worker.config import worker_config_from_args
from tests.deploy import gflags
from tests.deploy.chart import (CHART, FULLNAME, KUBE_VERSIONS, VALUES, Manifests, container, helm, port_number,
                                render, render_error, render_text)
from tests.deploy.test_chart_network import (NEIGHBOUR, OTHER_APP, OUTSIDE, PROMETHEUS, Source, _peer_matches,
                                             _selects, component)
from tests.deploy.test_chart_pods import deployment, parse
from tests.deploy.test_chart_schema import SCHEMA

MC = "mooncake"   # ci/mooncake-values.yaml: three store nodes of 32 GiB, two replicas, TCP
MASTER = f"{FULLNAME}-mooncake"
STORE = f"{FULLNAME}-mooncake-store"
GiB = 1 << 30
RDMA = {"kvstore": {"backend": {"mooncake": {"protocol": "rdma", "rdma": {
    "devices": "mlx5_0,mlx5_1", "resources": {"rdma/hca_shared_devices_a": 1}}}}}}


def _with(tmp_path, values: dict, name: str = "extra") -> Manifests:
    """The mooncake values with `values` on top (a file: --set would pass numbers as strings)."""
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(values))
    return Manifests([d for d in yaml.safe_load_all(render_text(VALUES[MC], extra_files=(path,))) if d])


def _error_with(tmp_path, values: dict) -> str:
    path = tmp_path / "extra.yaml"
    path.write_text(yaml.safe_dump(values))
    return render_error(values=VALUES[MC], extra_files=(path,))


def _flags(program: str, c: dict, pod_ip: str = "10.1.2.3") -> dict[str, str]:
    """The container's flags as the installed Mooncake binary parses them ($(POD_IP) expanded
    as the kubelet would, from the downward API)."""
    assert c["command"] == [program]
    return gflags.parse(program, [a.replace("$(POD_IP)", pod_ip) for a in c["args"]])


def _env(c: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}


def _pdserve_up_flags(index: int) -> set[str]:
    """The flag names `pdserve up --kvstore-backend mooncake` gives the master (0) or a store node (1)."""
    gflags.binary("mooncake_master")  # skips without the mooncake package, as processes() needs it
    argv = MooncakePlan(replicas=1).processes("127.0.0.1", 1 << 26)[index][1]
    return {a[2:].split("=", 1)[0] for a in argv[1:]}


def test_the_topology_one_master_the_store_nodes_and_the_kvstore_as_their_index():
    m = render(MC)
    master = m.get("Deployment", MASTER)
    assert master["spec"]["replicas"] == 1
    assert master["spec"]["strategy"] == {"type": "Recreate"}  # never two masters
    store = m.get("Deployment", STORE)
    assert store["spec"]["replicas"] == 3
    assert store["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    assert deployment(m, "kvstore")["spec"]["replicas"] == 1
    service = m.get("Service", MASTER)
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {"rpc": 50100, "metadata": 50101,
                                                                          "metrics": 9090}
    master_labels = master["spec"]["template"]["metadata"]["labels"]
    store_labels = store["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= master_labels.items()
    assert not service["spec"]["selector"].items() <= store_labels.items()
    named = {p["name"] for p in container(master)["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= named
    pdb = m.get("PodDisruptionBudget", STORE)
    assert pdb["spec"]["maxUnavailable"] == 1 and pdb["spec"]["selector"]["matchLabels"].items() <= store_labels.items()
    # spread over the cluster's nodes by default: a node lost takes one copy of a block
    (term,) = store["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert term["podAffinityTerm"]["labelSelector"]["matchLabels"].items() <= store_labels.items()
    assert not m.of_kind("StatefulSet")
    # Mooncake's programs come with the kvstore's image (its Mooncake wheel), no GPU
    for d in (master, store):
        assert container(d)["image"] == container(deployment(m, "kvstore"))["image"] == "pdserve:0.1.0-cpu"
        assert "nvidia.com/gpu" not in str(container(d)["resources"])


def test_an_affinity_of_your_own_replaces_the_spread(tmp_path):
    mine = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["memory"]}]}]}}}
    m = _with(tmp_path, {"kvstore": {"backend": {"mooncake": {"store": {"affinity": mine}}}}})
    assert m.get("Deployment", STORE)["spec"]["template"]["spec"]["affinity"] == mine


def test_the_kvstore_indexes_the_plane_with_flags_pdserve_accepts():
    args = parse(container(deployment(render(MC), "kvstore")))
    assert args.command == "kvstore" and args.backend == "mooncake"
    assert mooncake_settings(args) == MooncakeSettings(
        master=f"{MASTER}:50100", metadata_server=f"http://{MASTER}:50101/metadata", replicas=2, protocol="tcp",
        rdma_devices="", failover_s=DEFAULT_FAILOVER_S)  # 2 x the master's --client_ttl + 2, as pdserve up
    config_from_args(args)  # the kvstore's whole check of its flags
    # the index holds 0.85 (pdserve up's share) of what three 32 GiB segments hold in two copies
    assert args.capacity_bytes == int(3 * 32 * GiB * INDEX_SHARE / 2)


def test_one_replica_needs_no_failover(tmp_path):
    m = _with(tmp_path, {"kvstore": {"backend": {"mooncake": {"replicas": 1}}}})
    args = parse(container(deployment(m, "kvstore")))
    assert args.mooncake_failover_s is None and mooncake_settings(args).failover_s == 0.0
    assert args.capacity_bytes == int(3 * 32 * GiB * INDEX_SHARE)


@pytest.mark.parametrize("pool", ["prefill", "decode"])
def test_the_workers_move_the_bytes_over_mooncake(pool):
    args = parse(container(deployment(render(MC), pool)))
    assert args.kvstore_transport == "mooncake" and args.kvstore == f"{FULLNAME}-kvstore:50060"
    assert worker_config_from_args(args).kvstore_transport == "mooncake"


def test_the_master_runs_with_flags_mooncake_master_accepts():
    m = render(MC)
    c = container(m.get("Deployment", MASTER))
    flags = _flags("mooncake_master", c)
    assert flags["rpc_port"] == str(port_number(c, "rpc")) == "50100"
    assert flags["http_metadata_server_port"] == str(port_number(c, "metadata")) == "50101"
    assert flags["metrics_port"] == str(port_number(c, "metrics")) == "9090"
    assert flags["enable_http_metadata_server"] == "true"
    assert flags["rpc_address"] == flags["http_metadata_server_host"] == flags["metrics_host"] == "0.0.0.0"
    assert flags["client_ttl"] == str(MASTER_CLIENT_TTL_S)
    assert (float(flags["eviction_high_watermark_ratio"]), float(flags["eviction_ratio"])) == (0.9, 0.05)
    assert float(flags["eviction_high_watermark_ratio"]) > INDEX_SHARE
    assert _pdserve_up_flags(0) <= set(flags)  # everything pdserve up sets, the chart sets too


def test_the_store_nodes_run_with_flags_mooncake_client_accepts():
    m = render(MC)
    c = container(m.get("Deployment", STORE))
    flags = _flags("mooncake_client", c)
    assert flags["global_segment_size"] == str(32 * GiB)
    assert flags["master_server_address"] == f"{MASTER}:50100"
    assert flags["metadata_server"] == f"http://{MASTER}:50101/metadata"
    assert flags["protocol"] == "tcp" and "device_names" not in flags
    assert flags["port"] == str(port_number(c, "client"))
    assert flags["enable_http_server"] == "true" and flags["http_port"] == str(port_number(c, "metrics"))
    # the segment is advertised at the pod's own IP, which the workers dial
    assert flags["host"] == "10.1.2.3"
    env = _env(c)
    assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert (env["MC_MIN_RPC_PORT"], env["MC_MAX_RPC_PORT"]) == ("15000", "15015")
    # logLevel INFO: Mooncake's INFO is every connection, so WARNING and up (glog's level,
    # and the transfer engine's, which sets glog's again)
    assert (env["GLOG_logtostderr"], env["GLOG_minloglevel"], env["MC_LOG_LEVEL"]) == ("1", "1", "WARNING")
    assert _pdserve_up_flags(1) <= set(flags)
    # the segment and 512 MiB fit the memory limit (33Gi for 32 GiB)
    assert c["resources"]["limits"]["memory"] == "33Gi"


def test_probes_ask_mooncake_for_health_on_named_ports():
    m = render(MC)
    for name, live in ((MASTER, "rpc"), (STORE, "metrics")):
        c = container(m.get("Deployment", name))
        ports = {p["name"] for p in c["ports"]}
        for probe in ("startupProbe", "readinessProbe"):
            assert c[probe]["httpGet"] == {"path": "/health", "port": "metrics"}, (name, probe)
        assert c["livenessProbe"]["tcpSocket"] == {"port": live} and live in ports


def test_mooncake_objects_exist_only_with_the_mooncake_backend():
    for name in VALUES:
        if name == MC:
            continue
        m = render(name)
        components = {d["metadata"]["labels"].get("app.kubernetes.io/component") for d in m.docs}
        assert not components & {"mooncake-master", "mooncake-store"}, name
        assert "--backend=mooncake" not in container(deployment(m, "kvstore"))["args"]


# --- NetworkPolicy: Mooncake authenticates nobody, so these rules are its fence ---

def _reaches(m: Manifests, src: Source, target: str, port: int | str) -> bool:
    """Whether `src` may open a connection to `port` (a number or a container port's name)
    of the pods of component `target`, under the release's NetworkPolicies (port ranges
    with endPort included)."""
    ((labels, spec),) = [(meta["labels"], s) for _, meta, s in m.pod_specs()
                         if meta["labels"]["app.kubernetes.io/component"] == target]
    named = {p["name"]: p["containerPort"] for c in spec["containers"] for p in c.get("ports", [])}
    number = named[port] if isinstance(port, str) else port
    selecting = [p for p in m.of_kind("NetworkPolicy") if _selects(p["spec"]["podSelector"], labels)]
    if not selecting:
        return True

    def port_matches(rule_ports) -> bool:
        for p in rule_ports or [{}]:
            if not p:
                return True
            if isinstance(p["port"], str):
                if named.get(p["port"]) == number:
                    return True
            elif p["port"] <= number <= p.get("endPort", p["port"]):
                return True
        return False

    return any(port_matches(rule.get("ports")) and (not rule.get("from") or any(
        _peer_matches(peer, src) for peer in rule["from"]))
        for policy in selecting for rule in policy["spec"].get("ingress", []))


def test_the_store_nodes_take_transfers_from_the_workers_only():
    m = render(MC)
    for worker in ("prefill", "decode"):
        for port in (15000, 15007, 15015):
            assert _reaches(m, component(worker), "mooncake-store", port), (worker, port)
        for port in (14999, 15016, "client"):  # outside the pinned range, and the client service port
            assert not _reaches(m, component(worker), "mooncake-store", port), (worker, port)
    others = (component("router"), component("kvstore"), component("mooncake-master"),
              component("prefill", release="other-release"), OUTSIDE, OTHER_APP, NEIGHBOUR, PROMETHEUS)
    for src in others:
        assert not _reaches(m, src, "mooncake-store", 15007), src
    assert _reaches(m, PROMETHEUS, "mooncake-store", "metrics")


def test_the_master_takes_mooncake_clients_only():
    m = render(MC)
    for client in ("kvstore", "prefill", "decode", "mooncake-store"):
        for port in ("rpc", "metadata"):
            assert _reaches(m, component(client), "mooncake-master", port), (client, port)
    for src in (component("router"), component("decode", release="other-release"), OUTSIDE, OTHER_APP, NEIGHBOUR,
                PROMETHEUS):
        assert not _reaches(m, src, "mooncake-master", "rpc") and not _reaches(m, src, "mooncake-master", "metadata")
    assert _reaches(m, PROMETHEUS, "mooncake-master", "metrics")
    # nothing of Mooncake's reaches pdserve's own ports
    for target in ("kvstore", "prefill", "decode"):
        for src in ("mooncake-master", "mooncake-store"):
            assert not _reaches(m, component(src), target, "grpc"), (src, target)


def test_the_fence_follows_the_port_range(tmp_path):
    m = _with(tmp_path, {"kvstore": {"backend": {"mooncake": {"store": {"transferPorts": {"first": 31000,
                                                                                          "last": 31099}}}}}})
    store = container(m.get("Deployment", STORE))
    assert (_env(store)["MC_MIN_RPC_PORT"], _env(store)["MC_MAX_RPC_PORT"]) == ("31000", "31099")
    assert _reaches(m, component("decode"), "mooncake-store", 31099)
    assert not _reaches(m, component("decode"), "mooncake-store", 15000)


# --- RDMA: configured and rendered; untested on a fabric (no RDMA device where this runs) ---

def test_rdma_reaches_every_transfer_engine(tmp_path):
    m = _with(tmp_path, RDMA)
    kvstore = parse(container(deployment(m, "kvstore")))
    settings = mooncake_settings(kvstore)  # what the workers learn from the kvstore
    assert (settings.protocol, settings.rdma_devices) == ("rdma", "mlx5_0,mlx5_1")
    store = container(m.get("Deployment", STORE))
    flags = _flags("mooncake_client", store)
    assert (flags["protocol"], flags["device_names"]) == ("rdma", "mlx5_0,mlx5_1")
    assert store["resources"]["limits"] == {"memory": "33Gi", "rdma/hca_shared_devices_a": 1}
    for pool in ("prefill", "decode"):
        limits = container(deployment(m, pool))["resources"]["limits"]
        assert limits["rdma/hca_shared_devices_a"] == 1 and limits["nvidia.com/gpu"] == 1
    for name in ("kvstore", "router"):  # no transfers of their own
        assert "rdma/hca_shared_devices_a" not in str(container(deployment(m, name))["resources"])
    assert "rdma" not in str(container(m.get("Deployment", MASTER))["resources"])
    # no hostNetwork and no added capability: the NetworkPolicy still selects every pod
    for _, _, spec in m.pod_specs():
        assert not spec.get("hostNetwork")
        for c in spec["containers"]:
            assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_the_rdma_render_passes_helm_lint_and_kubernetes_validate(kube_version, tmp_path):
    extra = tmp_path / "rdma.yaml"
    extra.write_text(yaml.safe_dump(RDMA))
    done = helm("lint", "--strict", str(CHART), "--kube-version", kube_version, "-f", str(VALUES[MC]), "-f", str(extra))
    assert done.returncode == 0 and "0 chart(s) failed" in done.stdout, done.stdout + done.stderr
    rendered = tmp_path / "rendered.yaml"
    rendered.write_text(render_text(VALUES[MC], kube_version=kube_version, extra_files=(extra,)))
    done = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", "-k", kube_version, str(rendered)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert not [line for line in done.stdout.splitlines() if line.startswith(("ERROR", "FATAL", "WARN"))]


# --- values refused at render time, naming the value ---

@pytest.mark.parametrize("sets,where", [
    (("kvstore.backend.mooncake.replicas=9",), "/kvstore/backend/mooncake/replicas"),
    (("kvstore.backend.mooncake.protocol=ib",), "/kvstore/backend/mooncake/protocol"),
    (("kvstore.backend.mooncake.store.nodes=0",), "/kvstore/backend/mooncake/store/nodes"),
    (("kvstore.backend.mooncake.store.segmentGiB=0",), "/kvstore/backend/mooncake/store/segmentGiB"),
    (("kvstore.backend.mooncake.store.transferPorts.first=80",),
     "/kvstore/backend/mooncake/store/transferPorts/first"),
    (("kvstore.backend.mooncake.master.clientTtlSeconds=0",), "/kvstore/backend/mooncake/master/clientTtlSeconds"),
    (("kvstore.backend.mooncake.master.rpcPort=70000",), "/kvstore/backend/mooncake/master/rpcPort"),
    (("kvstore.backend.mooncake.rdma.devices=mlx5 0",), "/kvstore/backend/mooncake/rdma/devices"),
    (("kvstore.backend.mooncake.rdma.resources.rdma/hca=0",), "/kvstore/backend/mooncake/rdma/resources"),
    (("kvstore.backend.mooncake.store.segmentGB=8",), "'segmentGB'"),   # a typo is not ignored
])
def test_the_schema_refuses(sets, where):
    error = render_error(*sets, values=VALUES[MC])
    assert SCHEMA in error and where in error, error


@pytest.mark.parametrize("sets,message", [
    (("kvstore.replicas=2",), "kvstore.replicas=2 with kvstore.backend.type=mooncake: the block index lives in the "
                              "one kvstore process"),
    (("kvstore.transport=ucx",), "kvstore.transport=ucx with kvstore.backend.type=mooncake"),
    (("kvstore.transport=grpc",), "kvstore.transport=grpc with kvstore.backend.type=mooncake: the workers move the "
                                  "bytes over Mooncake's transfer engine; leave kvstore.transport=auto"),
    (("kvstore.backend.mooncake.replicas=4",),
     "kvstore.backend.mooncake.replicas=4 is above kvstore.backend.mooncake.store.nodes=3"),
    (("kvstore.backend.mooncake.protocol=rdma",),
     "kvstore.backend.mooncake.protocol=rdma needs kvstore.backend.mooncake.rdma.resources"),
    (("kvstore.backend.mooncake.rdma.devices=mlx5_0",),
     "kvstore.backend.mooncake.rdma.devices=mlx5_0 needs kvstore.backend.mooncake.protocol=rdma"),
    (("kvstore.backend.mooncake.rdma.resources.rdma/hca=1",),
     "kvstore.backend.mooncake.rdma.resources with kvstore.backend.mooncake.protocol=tcp"),
    (("kvstore.backend.mooncake.store.resources.limits=null",),
     "kvstore.backend.mooncake.store.resources.limits.memory is required"),
    (("kvstore.backend.mooncake.store.resources.limits.memory=32Gi",),
     "kvstore.backend.mooncake.store.segmentGiB=32 does not fit kvstore.backend.mooncake.store.resources.limits."
     "memory=32Gi"),
    (("kvstore.backend.mooncake.store.resources.limits.memory=lots",),
     "kvstore.backend.mooncake.store.resources.limits.memory=lots is not a Kubernetes quantity"),
    (("kvstore.backend.mooncake.store.transferPorts.last=15000",),
     "kvstore.backend.mooncake.store.transferPorts: first=15000, last=15000 leaves fewer than 2 ports"),
    (("kvstore.backend.mooncake.store.transferPorts.first=40000", "kvstore.backend.mooncake.store.transferPorts.last=40015"),
     "kvstore.backend.mooncake.store.transferPorts: 40000-40015 meets the ephemeral port range 32768-60999"),
    (("kvstore.backend.mooncake.store.transferPorts.last=32768",), "meets the ephemeral port range"),
    (("kvstore.backend.mooncake.store.port=15003",),
     "kvstore.backend.mooncake.store.port=15003 is inside kvstore.backend.mooncake.store.transferPorts"),
    (("metricsPort=15001",), "metricsPort=15001 is inside kvstore.backend.mooncake.store.transferPorts"),
    (("kvstore.backend.mooncake.store.port=9090",), "kvstore.backend.mooncake.store.port=9090 is also metricsPort"),
    (("kvstore.backend.mooncake.master.metadataPort=50100",),
     "kvstore.backend.mooncake.master: rpcPort, metadataPort and metricsPort must differ"),
    (("kvstore.disk.enabled=true",), "kvstore.disk.enabled=true needs kvstore.backend.type=memory: with mooncake"),
    (("redis.enabled=true",), "redis.enabled=true but kvstore.backend.type=mooncake"),
])
def test_values_that_cannot_work_together_are_refused_naming_them(sets, message):
    error = render_error(*sets, values=VALUES[MC])
    assert message in error, error


def test_an_eviction_watermark_below_the_index_share_is_refused(tmp_path):
    error = _error_with(tmp_path, {"kvstore": {"backend": {"mooncake": {"master": {
        "evictionHighWatermarkRatio": 0.85}}}}})
    assert "kvstore.backend.mooncake.master.evictionHighWatermarkRatio=0.85 must be above 0.85" in error, error


@pytest.mark.parametrize("limit,fits", [("33280Mi", True), ("33279Mi", False), (str(32 * GiB + (512 << 20)), True),
                                        ("35G", True), ("34G", False)])
def test_the_segment_must_fit_the_memory_limit_with_512mi_to_spare(limit, fits, tmp_path):
    extra = {"kvstore": {"backend": {"mooncake": {"store": {"resources": {"limits": {"memory": limit}}}}}}}
    if fits:
        _with(tmp_path, extra)
    else:
        assert "does not fit" in _error_with(tmp_path, extra)


# --- the rendered master and store node, started here ---

def _free_port() -> int:
    return free_port_range(1)  # below the ephemeral range: a process binds it later


def _free_range(size: int) -> int:
    """The first of `size` consecutive ports, all free, between 20000 and 32000."""
    for first in random.Random().sample(range(20000, 32000 - size, size), 64):
        try:
            with contextlib.ExitStack() as held:
                for port in range(first, first + size):
                    s = held.enter_context(socket.socket())
                    s.bind(("", port))
            return first
        except OSError:
            continue
    pytest.fail("no free range of ports between 20000 and 32000")


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status, r.read().decode()
    except OSError:
        return 0, ""


def _wait(what: str, check, procs, timeout_s: float = 45.0):
    deadline = time.monotonic() + timeout_s
    while not check():
        for p in procs:
            assert p.poll() is None, f"{p.args[0]} exited with {p.returncode} while waiting for {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_the_rendered_master_and_store_node_start_and_mount_the_segment(tmp_path):
    """One host stands for two pods: the master's Service name becomes `localhost` (still a
    name the store node must resolve, for the RPC and the metadata URL alike), the pod IP
    127.0.0.1, and the store node's metrics port (metricsPort in every pod) moves to a free
    one. Everything else is the rendered command line, env and probe path."""
    master_bin, client_bin = gflags.binary("mooncake_master"), gflags.binary("mooncake_client")
    rpc, metadata, metrics, client, store_metrics = (_free_port() for _ in range(5))  # ephemeral ports
    first = _free_range(16)  # below them, as Mooncake requires
    segment_gib = 1 / 16  # 64 MiB
    m = _with(tmp_path, {"listenHost": "127.0.0.1", "metricsPort": metrics, "kvstore": {"backend": {"mooncake": {
        "master": {"rpcPort": rpc, "metadataPort": metadata},
        "store": {"nodes": 3, "segmentGiB": segment_gib, "port": client,
                  "transferPorts": {"first": first, "last": first + 15}}}}}})
    master_c, store_c = container(m.get("Deployment", MASTER)), container(m.get("Deployment", STORE))
    store_args = [a.replace("$(POD_IP)", "127.0.0.1").replace(MASTER, "localhost") for a in store_c["args"]]
    store_args = [f"--http_port={store_metrics}" if a.startswith("--http_port=") else a for a in store_args]
    procs = []

    def start(binary, c, args, name):
        env = {**os.environ, **{e["name"]: e["value"] for e in c["env"] if "value" in e}, "POD_IP": "127.0.0.1"}
        log = open(tmp_path / f"{name}.log", "w")
        procs.append(subprocess.Popen([binary, *args], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path))
        return procs[-1]

    try:
        start(master_bin, master_c, master_c["args"], "master")
        probe = master_c["readinessProbe"]["httpGet"]["path"]
        _wait("the master's /health", lambda: _get(f"http://127.0.0.1:{metrics}{probe}")[0] == 200, procs)
        store = start(client_bin, store_c, store_args, "store")
        _wait("the store node's /health", lambda: _get(f"http://127.0.0.1:{store_metrics}/health")[0] == 200, procs)

        def mounted() -> bool:
            text = _get(f"http://127.0.0.1:{metrics}/metrics")[1]
            return f"master_total_capacity_bytes {int(segment_gib * GiB)}" in text
        _wait("the master to count the store node's segment", mounted, procs)
        # the transfer engine listens only where the NetworkPolicy opens (and the two fixed ports)
        listening = {c.laddr.port for c in psutil.Process(store.pid).net_connections("tcp")
                     if c.status == psutil.CONN_LISTEN}
        transfer = listening - {client, store_metrics}
        assert transfer and all(first <= p <= first + 15 for p in transfer), (listening, first)
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
