"""The router's decisions are a room without I/O: the simulator and the tests load them
without gRPC, FastAPI or torch (each checked in a fresh interpreter, where nothing else
has loaded them first)."""
from __future__ import annotations

import subprocess
import sys

from tests.test_import_graph import ROOT

HEAVY = ("grpc", "fastapi", "torch")


def modules_loaded_by(statement: str) -> list[str]:
    """Which of HEAVY are in sys.modules after `statement`, in a fresh interpreter."""
    code = f"import sys\n{statement}\nprint(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_the_decisions_and_the_simulators_router_load_no_grpc_fastapi_or_torch():
    modules = ", ".join(["pdserve.services.router.decide", "pdserve.sim.router", *(
        f"pdserve.services.router.decide.{m}" for m in ("config", "views", "paths", "policy", "placement", "saturation",
                                                 "slots"))])
    assert modules_loaded_by(f"import {modules}") == []


def test_the_router_starts_without_torch():
    assert "torch" not in modules_loaded_by("import pdserve.services.router.main")
    help_run = ("from pdserve.cli.main import main\ntry:\n    main(['router', '--help'])\nexcept SystemExit:\n    pass")
    assert "torch" not in modules_loaded_by(help_run)
