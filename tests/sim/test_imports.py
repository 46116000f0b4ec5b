"""The simulator is pure Python over a profile's tables: importing it starts no torch, no
web framework and never the profiler that runs the real engine (profiler/)."""
import subprocess
import sys

import pytest

# the modules of the simulator that do not reach the router's package; they load no gRPC
# either (the router's settings, services/router/config.py, still pull it in)
ROUTER_FREE = ("sim.profile", "sim.worker", "sim.trace", "sim.diurnal")
SIMULATOR = ROUTER_FREE + ("sim.cluster", "sim.metrics", "sim.main", "sim.plan", "sim.autoscale")


def loaded_after_import(module: str, candidates: tuple[str, ...]) -> list[str]:
    probe = f"import sys, {module}; print(' '.join(m for m in {candidates!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    return out.stdout.split()


@pytest.mark.parametrize("module", SIMULATOR)
def test_the_simulator_loads_no_torch_web_framework_or_profiler(module):
    assert loaded_after_import(module, ("torch", "fastapi", "profiler")) == []


@pytest.mark.parametrize("module", ROUTER_FREE)
def test_the_router_free_simulator_modules_load_no_grpc(module):
    assert loaded_after_import(module, ("grpc",)) == []
