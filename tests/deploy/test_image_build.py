"""What `make image` built (the cpu image), beyond what the chart's pods exercise
(tests/deploy/test_pods_podman.py): its layers stay small enough for the build to fit a
small disk, and a container runs the installed package, not a copy of the sources.

`make test-deploy` runs it after `make image` (pytest -m pods); `make test` leaves it out.
"""
from __future__ import annotations

import json

import pytest

from tests.deploy.chart import cpu_image
from tests.deploy.kubelet import ULIMITS, image_exists, podman

pytestmark = pytest.mark.pods

# Committing a layer holds it on disk three to four times over for a moment (the container's
# copy, the diff, the stored layer), so the largest layer sets the build's peak: one 3 GB
# layer peaked at 11.6 GiB over the start, three of ~1 GB at 7.9 GiB (docs/deployment.md).
LARGEST_LAYER_BYTES = 1.5e9


@pytest.fixture(scope="module")
def built() -> str:
    assert image_exists(cpu_image()), f"no image {cpu_image()}: `make image` builds it (make test-deploy does first)"
    return cpu_image()


def test_no_layer_of_the_image_is_large_enough_to_blow_up_the_build_s_disk_peak(built):
    history = json.loads(podman("history", "--format", "json", built).stdout)
    sizes = sorted((h["size"] for h in history), reverse=True)
    assert sum(sizes) > 2.5e9, "the venv (torch, triton, the package) is missing from the layers"
    assert sizes[0] <= LARGEST_LAYER_BYTES, f"a layer of {sizes[0] / 1e9:.2f} GB; the installs are meant to be split"
    assert sum(1 for s in sizes if s > 0.5e9) >= 3


def test_a_container_imports_the_installed_package_and_the_sources_are_gone(built):
    """As the chart runs it: read-only root, /tmp writable, uid 10001. `python -m` puts the
    working directory first on sys.path, so sources left there would shadow the package."""
    probe = ("import os, torch, pdserve.engine as engine, pdserve.services as services; "
             "print(engine.__file__, services.__path__[0], os.getcwd(), os.path.exists('/src'), torch.version.cuda)")
    out = podman("run", "--rm", "--read-only", "--tmpfs", "/tmp", "--user", "10001:10001", *ULIMITS,
                 "--entrypoint", "python", built, "-c", probe).stdout.split()
    engine_file, services_dir, cwd, sources_left, cuda = out
    assert engine_file.startswith("/opt/pdserve/lib/") and services_dir.startswith("/opt/pdserve/lib/")
    assert engine_file.endswith("/site-packages/pdserve/engine/__init__.py")
    assert (cwd, sources_left, cuda) == ("/", "False", "None")
