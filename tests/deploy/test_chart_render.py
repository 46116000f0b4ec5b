"""The chart as helm and the Kubernetes API schemas see it: `helm lint --strict`, and every
rendered object through `kubernetes-validate --strict`, for each values file and each
Kubernetes version (chart.KUBE_VERSIONS)."""
from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from tests.deploy.chart import CHART, KUBE_VERSIONS, VALUES, helm, render, render_error, render_text

# Kinds no built-in schema knows (CRDs): kubernetes-validate can only warn about them.
CRD_KINDS = {"ServiceMonitor"}


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("name", list(VALUES))
def test_helm_lint_strict(name, kube_version):
    args = ["lint", "--strict", str(CHART), "--kube-version", kube_version]
    if VALUES[name] is not None:
        args += ["-f", str(VALUES[name])]
    done = helm(*args)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in done.stdout


def _validate(files, kube_version: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", "-k", kube_version,
                           *map(str, files)], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_every_rendered_object_passes_kubernetes_validate_strict(kube_version, tmp_path):
    files, num_objects = [], 0
    for name, values_file in VALUES.items():
        text = render_text(values_file, kube_version=kube_version)
        num_objects += sum(1 for d in yaml.safe_load_all(text) if d and d["kind"] not in CRD_KINDS)
        files.append(tmp_path / f"{name}.yaml")
        files[-1].write_text(text)
    done = _validate(files, kube_version)
    lines = done.stdout.splitlines()
    assert done.returncode == 0, done.stdout + done.stderr
    assert not [line for line in lines if line.startswith(("ERROR", "FATAL"))]
    warnings = [line for line in lines if line.startswith("WARN")]
    assert all(any(f"kind {k} " in line for k in CRD_KINDS) for line in warnings), warnings
    # every object was checked against a schema, none skipped for want of one
    assert sum(1 for line in lines if line.startswith("INFO") and "passed" in line) == num_objects


def test_kubernetes_validate_catches_a_misspelled_field(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text(render_text().replace("enableServiceLinks:", "enableServiceLink:"))
    done = _validate([broken], KUBE_VERSIONS[0])
    assert done.returncode != 0 and "'enableServiceLink' was unexpected" in done.stdout


def test_the_prestop_pause_uses_what_the_cluster_version_has():
    """The sleep action (no binary needed) from 1.30; before that, `sleep` in the image."""
    def pre_stop(kube_version):
        pod = render("default", kube_version).get("Deployment", "rel-pdserve-decode")["spec"]["template"]["spec"]
        return pod["containers"][0]["lifecycle"]["preStop"]
    assert pre_stop("1.29.0") == {"exec": {"command": ["sleep", "5"]}}
    assert pre_stop("1.35.0") == {"sleep": {"seconds": 5}}


def test_clusters_older_than_the_chart_supports_are_refused():
    assert "chart requires kubeVersion: >=1.27.0-0" in render_error(kube_version="1.26.0")


def _notes(*sets: str) -> str:
    args = ["install", "rel", str(CHART), "--namespace", "llm", "--dry-run=client"]
    for s in sets:
        args += ["--set", s]
    done = helm(*args)
    assert done.returncode == 0, done.stderr
    return done.stdout.split("NOTES:", 1)[1]


def test_notes_tell_how_to_reach_the_router_over_grpc_and_http():
    notes = _notes()
    assert "rel-pdserve-router.llm.svc:50051 (gRPC)" in notes and "rel-pdserve-router.llm.svc:8000 (HTTP)" in notes
    assert "kubectl port-forward -n llm svc/rel-pdserve-router 50051:50051 8000:8000" in notes
    assert "pdserve generate --url $ROUTER_GRPC" in notes and "curl http://$ROUTER_HTTP/v1/chat/completions" in notes
    node_port = _notes("router.service.type=NodePort", "router.http.enabled=false")
    assert '@.name=="grpc")].nodePort' in node_port and "ROUTER_HTTP" not in node_port
