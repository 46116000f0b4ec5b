"""What a kubelet does with one of the chart's rendered pods, done with podman on this
machine: the container from its image with the rendered command and args, the env (values,
Secret and ConfigMap references resolved from the rendered manifests, `$(VAR)` expanded),
the volumes (emptyDir, ConfigMap and Secret files, the service account's token), the
security context, the resource limits, host networking on loopback with the Service names
resolving there; its startup, readiness and liveness probes run as the kubelet runs them
(gRPC health, TCP, HTTP GET); termination as on scale-down: the preStop hook, SIGTERM,
then SIGKILL once the grace period is over.

It is not a Kubernetes cluster (none can run here): scheduling, Services' virtual IPs,
NetworkPolicies and the API server's admission are not exercised.
"""
from __future__ import annotations

import base64
import re
import shutil
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

PODMAN = ("podman", "--runtime", "/usr/sbin/runc", "--cgroup-manager", "cgroupfs")
ULIMITS = ("--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096")
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([*PODMAN, *args], capture_output=True, text=True, timeout=timeout, check=check)


def image_exists(image: str) -> bool:
    return shutil.which("podman") is not None and podman("image", "exists", image, check=False).returncode == 0


@dataclass(frozen=True)
class Cluster:
    """What the rendered pods refer to outside themselves."""
    manifests: list[dict]
    hosts: tuple[str, ...]                        # Service names, resolved to 127.0.0.1
    service_account: Path | None = None           # token, ca.crt, namespace (the router's)
    api_server: tuple[str, int] | None = None     # KUBERNETES_SERVICE_HOST / _PORT

    def find(self, kind: str, name: str) -> dict:
        (found,) = [d for d in self.manifests if d["kind"] == kind and d["metadata"]["name"] == name]
        return found


@dataclass
class Pod:
    name: str
    spec: dict
    folder: Path
    container_id: str = ""
    events: list[str] = field(default_factory=list)
    sigterm_at: float | None = None      # time.monotonic() when terminate() sent SIGTERM

    @property
    def container(self) -> dict:
        (c,) = self.spec["containers"]
        return c

    def port(self, name: str) -> int:
        return next(p["containerPort"] for p in self.container["ports"] if p["name"] == name)

    def logs(self) -> str:
        done = podman("logs", self.container_id, check=False) if self.container_id else None
        return (done.stdout + done.stderr) if done else ""

    def state(self) -> tuple[str, int]:
        """(status, exit code). Podman says "stopped" for a container whose process has ended
        (its exit code read) until its cleanup process marks it "exited"; that cleanup runs
        asynchronously, so the two are one state here."""
        out = podman("inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}", self.container_id).stdout.split()
        status = "exited" if out[0] == "stopped" else out[0]
        return status, int(out[1])


def run_pod(name: str, spec: dict, cluster: Cluster, folder: Path) -> Pod:
    """Start the pod's one container, detached; returns at once (probes come next)."""
    pod = Pod(name, spec, folder)
    folder.mkdir(parents=True, exist_ok=True)
    c = pod.container
    env = resolve_env(c.get("env", []), cluster)
    argv = [*PODMAN, "run", "--detach", "--name", name, "--network", "host", *ULIMITS,
            *_hosts(cluster), *_security(spec, c), *_resources(c.get("resources", {})),
            *_volumes(spec, c, cluster, folder)]
    for key, value in env.items():
        argv += ["--env", f"{key}={value}"]
    if spec.get("automountServiceAccountToken") and cluster.service_account and cluster.api_server:
        argv += ["--volume", f"{cluster.service_account}:{SERVICE_ACCOUNT_DIR}:ro",
                 "--env", f"KUBERNETES_SERVICE_HOST={cluster.api_server[0]}",
                 "--env", f"KUBERNETES_SERVICE_PORT={cluster.api_server[1]}"]
    if c.get("command"):
        argv += ["--entrypoint", c["command"][0]]
    argv.append(c["image"])
    argv += [*c.get("command", [])[1:], *(expand(a, env) for a in c.get("args", []))]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"podman run {name}: {done.stderr}"
    pod.container_id = done.stdout.strip()
    return pod


def expand(arg: str, env: dict[str, str]) -> str:
    """$(VAR) as the kubelet expands it in command and args."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), arg)


def resolve_env(entries: list[dict], cluster: Cluster) -> dict[str, str]:
    env: dict[str, str] = {}
    for e in entries:
        if "value" in e:
            env[e["name"]] = expand(e["value"], env)
        elif ref := e.get("valueFrom", {}).get("secretKeyRef"):
            env[e["name"]] = _secret_data(cluster.find("Secret", ref["name"]))[ref["key"]]
        elif ref := e.get("valueFrom", {}).get("configMapKeyRef"):
            env[e["name"]] = cluster.find("ConfigMap", ref["name"])["data"][ref["key"]]
        else:
            raise AssertionError(f"env {e['name']}: a source this runner does not know: {e}")
    return env


def _secret_data(secret: dict) -> dict[str, str]:
    data = {k: base64.b64decode(v).decode() for k, v in secret.get("data", {}).items()}
    return {**data, **secret.get("stringData", {})}


def _hosts(cluster: Cluster) -> list[str]:
    return [arg for host in cluster.hosts for arg in ("--add-host", f"{host}:127.0.0.1")]


def _security(spec: dict, c: dict) -> list[str]:
    pod_ctx, ctx = spec.get("securityContext", {}), c.get("securityContext", {})
    user, group = ctx.get("runAsUser", pod_ctx.get("runAsUser")), ctx.get("runAsGroup", pod_ctx.get("runAsGroup"))
    flags = ["--user", f"{user}:{group}"] if user is not None else []
    if "fsGroup" in pod_ctx:
        flags += ["--group-add", str(pod_ctx["fsGroup"])]
    if ctx.get("readOnlyRootFilesystem"):
        flags.append("--read-only")
    if ctx.get("allowPrivilegeEscalation") is False:
        flags += ["--security-opt", "no-new-privileges"]
    for cap in ctx.get("capabilities", {}).get("drop", []):
        flags += ["--cap-drop", cap]
    # seccompProfile RuntimeDefault: podman's default profile is the runtime's default
    return flags


def _resources(resources: dict) -> list[str]:
    limits, requests = resources.get("limits", {}), resources.get("requests", {})
    flags = []
    if "memory" in limits:
        flags += ["--memory", _bytes(limits["memory"])]
    if "cpu" in limits:
        flags += ["--cpus", str(_cpus(limits["cpu"]))]
    if "cpu" in requests:  # requests become CPU shares, 1024 per core, as the kubelet sets them
        flags += ["--cpu-shares", str(max(2, int(_cpus(requests["cpu"]) * 1024)))]
    return flags


def _bytes(quantity: str) -> str:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9}
    match = re.fullmatch(r"(\d+)([A-Za-z]*)", str(quantity))
    return str(int(match.group(1)) * units.get(match.group(2), 1))


def _cpus(quantity) -> float:
    text = str(quantity)
    return int(text[:-1]) / 1000 if text.endswith("m") else float(text)


def _volumes(spec: dict, c: dict, cluster: Cluster, folder: Path) -> list[str]:
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    fs_group = spec.get("securityContext", {}).get("fsGroup")
    flags = []
    for mount in c.get("volumeMounts", []):
        volume = volumes[mount["name"]]
        source = folder / "volumes" / mount["name"]
        source.mkdir(parents=True, exist_ok=True)
        if "emptyDir" in volume:
            shutil.chown(source, group=fs_group) if fs_group is not None else None
            source.chmod(0o2777)   # writable by the pod's uid, group-owned by its fsGroup as the kubelet makes it
        elif "configMap" in volume:
            _write_files(source, cluster.find("ConfigMap", volume["configMap"]["name"])["data"])
        elif "secret" in volume:
            _write_files(source, _secret_data(cluster.find("Secret", volume["secret"]["secretName"])))
        else:
            raise AssertionError(f"volume {mount['name']}: a kind this runner does not know: {volume}")
        flags += ["--volume", f"{source}:{mount['mountPath']}:{'ro' if mount.get('readOnly') else 'rw'}"]
    return flags


def _write_files(folder: Path, data: dict[str, str]) -> None:
    for key, text in data.items():
        (folder / key).write_text(text)
        (folder / key).chmod(0o644)


# --- probes, as the kubelet runs them ---

def probe_once(probe: dict, pod: Pod) -> bool:
    timeout_s = probe.get("timeoutSeconds", 1)
    try:
        if "grpc" in probe:
            with grpc.insecure_channel(f"127.0.0.1:{probe['grpc']['port']}") as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=probe["grpc"].get("service", "")), timeout=timeout_s)
            return reply.status == health_pb2.HealthCheckResponse.SERVING
        if "tcpSocket" in probe:
            port = probe["tcpSocket"]["port"]
            with socket.create_connection(("127.0.0.1", pod.port(port) if isinstance(port, str) else port),
                                          timeout=timeout_s):
                return True
        if "httpGet" in probe:
            port = probe["httpGet"]["port"]
            port = pod.port(port) if isinstance(port, str) else port
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{probe['httpGet'].get('path', '/')}",
                                        timeout=timeout_s) as r:
                return 200 <= r.status < 400
    except (grpc.RpcError, OSError):
        return False
    raise AssertionError(f"a probe this runner does not know: {probe}")


def wait_started(pod: Pod, poll_s: float = 1.0) -> float:
    """The startup probe until it succeeds, within periodSeconds x failureThreshold (polled
    every `poll_s`, sooner than the period, so the test does not wait out whole periods);
    returns the seconds it took. Then readiness and liveness must each succeed."""
    probe = pod.container["startupProbe"]
    budget_s = probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)
    start = time.monotonic()
    while not probe_once(probe, pod):
        status, code = pod.state()
        assert status == "running", f"{pod.name} exited ({code}) before it started:\n{pod.logs()[-4000:]}"
        assert time.monotonic() - start < budget_s, \
            f"{pod.name}: startup probe failed for {budget_s} s; its log ends:\n{pod.logs()[-4000:]}"
        time.sleep(poll_s)
    took = time.monotonic() - start
    for kind in ("readinessProbe", "livenessProbe"):
        assert probe_once(pod.container[kind], pod), f"{pod.name}: {kind} failed after startup"
    pod.events.append(f"started in {took:.1f} s")
    return took


def terminate(pod: Pod, on_pre_stop=None) -> float:
    """Scale-down's termination: `on_pre_stop()` (the endpoint leaving the Services, which
    happens as the pod is marked for deletion), the preStop hook, SIGTERM, then SIGKILL when
    terminationGracePeriodSeconds (counted from the start) runs out. Returns the seconds to exit."""
    start = time.monotonic()
    grace_s = pod.spec.get("terminationGracePeriodSeconds", 30)
    if on_pre_stop:
        on_pre_stop()
    pre_stop = pod.container.get("lifecycle", {}).get("preStop", {})
    if "sleep" in pre_stop:
        time.sleep(pre_stop["sleep"]["seconds"])
    elif pre_stop:
        raise AssertionError(f"a preStop hook this runner does not know: {pre_stop}")
    podman("kill", "--signal", "TERM", pod.container_id)
    pod.sigterm_at = time.monotonic()
    pod.events.append(f"SIGTERM after {pod.sigterm_at - start:.1f} s")
    while pod.state()[0] in ("running", "stopping"):
        if time.monotonic() - start > grace_s:
            podman("kill", "--signal", "KILL", pod.container_id, check=False)
            pod.events.append("SIGKILL: the grace period ran out")
            break
        time.sleep(0.2)
    return time.monotonic() - start


def remove(pod: Pod) -> None:
    if pod.container_id:
        podman("rm", "--force", "--time", "0", pod.container_id, check=False)
