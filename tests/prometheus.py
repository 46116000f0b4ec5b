"""A real Prometheus for a local `pdserve up` platform: its scrape config, and the server.
Test support: the chart's adapter rules and dashboard are checked against it
(tests/services/test_prometheus.py); no command of the product runs a Prometheus.

In a cluster the chart's ServiceMonitor has the Prometheus Operator scrape every `metrics`
port, and the operator's relabelling gives each series the labels the adapter rules and
the dashboard select on. The config written here gives a local platform the same ones:

    namespace   the platform's stand-in namespace (LOCAL_NAMESPACE)
    pod         the process's name: kvstore, prefill-0, decode-1, router
    service     <release>-<component>, as the chart names its Services (rel-pdserve-prefill)
    job         the same as service (the operator's default)
    endpoint    metrics (the port's name)

`PrometheusServer` runs Debian's `prometheus` binary (`make prometheus`) on loopback
with its own data dir, and is stopped by its PID.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

import yaml

COMPONENTS = ("router", "prefill", "decode", "kvstore")
LOCAL_NAMESPACE = "pdserve-local"
LOCAL_RELEASE = "pdserve"  # the chart's fullname for a release named pdserve


@dataclass(frozen=True)
class ScrapeTarget:
    pod: str        # the process's name (ProcessSpec.name)
    component: str  # one of COMPONENTS
    address: str    # host:port of its /metrics


def targets(specs, host: str) -> list[ScrapeTarget]:
    """One target per process of a plan (cli/launcher.py `plan()`): every one serves
    /metrics on its `metrics_port`."""
    found = []
    for spec in specs:
        component = spec.name.split("-")[0]
        if component not in COMPONENTS:
            raise ValueError(f"process {spec.name!r}: not one of {', '.join(COMPONENTS)}")
        found.append(ScrapeTarget(spec.name, component, f"{host}:{spec.metrics_port}"))
    return found


def scrape_config(scrape_targets: list[ScrapeTarget], interval_s: float = 1.0, namespace: str = LOCAL_NAMESPACE,
                  release: str = LOCAL_RELEASE) -> dict:
    """Prometheus's configuration: one job per component (the operator's job per Service),
    one static target per process."""
    if interval_s <= 0:
        raise ValueError(f"interval_s: must be > 0, got {interval_s}")
    interval = f"{round(interval_s * 1000)}ms"
    jobs = []
    for component in COMPONENTS:
        service = f"{release}-{component}"
        static = [{"targets": [t.address],
                   "labels": {"namespace": namespace, "pod": t.pod, "service": service, "endpoint": "metrics"}}
                  for t in scrape_targets if t.component == component]
        if static:
            jobs.append({"job_name": service, "metrics_path": "/metrics", "scrape_interval": interval,
                         "scrape_timeout": interval, "static_configs": static})
    return {"global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval},
            "scrape_configs": jobs}


def write_scrape_config(path: str, config: dict) -> str:
    with open(path, "w") as f:
        yaml.safe_dump(config, f, sort_keys=False)
    return path


class PromQLError(RuntimeError):
    """Prometheus refused a query (bad syntax, bad types): its own message."""


class PrometheusServer:
    """One `prometheus` process: loopback only, its own port and data dir."""

    def __init__(self, config_path: str, data_dir: str, port: int = 0, binary: str = "prometheus",
                 host: str = "127.0.0.1"):
        self.config_path, self.data_dir, self.binary, self.host = config_path, data_dir, binary, host
        self.port = port or _free_port(host)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> "PrometheusServer":
        """Start it and return once /-/ready says so; raises with its log when it exits."""
        os.makedirs(self.data_dir, exist_ok=True)
        log_path = os.path.join(self.data_dir, "prometheus.log")
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(
                [self.binary, f"--config.file={self.config_path}", f"--storage.tsdb.path={self.data_dir}",
                 f"--web.listen-address={self.host}:{self.port}", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while not self.ready():
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited ({self.proc.returncode}):\n{open(log_path).read()[-4000:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"prometheus not ready at {self.url} after {timeout_s:.0f} s")
            time.sleep(0.1)
        return self

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        """An instant query (/api/v1/query): the result's vector, or PromQLError."""
        params = {"query": expr, **({"time": f"{at:.3f}"} if at is not None else {})}
        url = f"{self.url}/api/v1/query?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                body = json.load(r)
        except urllib.error.HTTPError as e:  # 400 / 422: a JSON body with the reason
            body = json.loads(e.read() or b"{}")
        if body.get("status") != "success":
            raise PromQLError(f"{expr}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]["result"]

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM by PID, SIGKILL after `grace_s`."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def __enter__(self) -> "PrometheusServer":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


def _free_port(host: str) -> int:
    # Prometheus cannot report a port it chose itself (:0), so one is picked for it here
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
