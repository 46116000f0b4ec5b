"""The simulator is pure Python over a profile's tables: importing it starts no torch, no
gRPC, no web framework and never the profiler that runs the real engine (profiler/)."""
import subprocess
import sys

import pytest

SIMULATOR = ("pdserve.sim.profile", "pdserve.sim.worker", "pdserve.sim.trace", "pdserve.sim.diurnal", "pdserve.sim.router", "pdserve.sim.cluster", "pdserve.sim.metrics",
             "pdserve.sim.main", "pdserve.sim.plan", "pdserve.sim.autoscale")


def loaded_after_import(module: str, candidates: tuple[str, ...]) -> list[str]:
    probe = f"import sys, {module}; print(' '.join(m for m in {candidates!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    return out.stdout.split()


@pytest.mark.parametrize("module", SIMULATOR)
def test_the_simulator_loads_no_torch_grpc_web_framework_or_profiler(module):
    assert loaded_after_import(module, ("torch", "grpc", "fastapi", "pdserve.profiler")) == []
