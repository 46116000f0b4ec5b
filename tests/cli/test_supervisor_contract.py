"""The supervisor works on any platform that keeps the `Supervised` contract, so it never
imports the launcher that starts it (the launcher's Platform keeps the contract)."""
import subprocess
import sys

from pdserve.cli.launcher import Platform
from pdserve.cli.supervisor import Supervised


def test_the_launchers_platform_keeps_the_supervised_contract():
    platform = Platform([])
    assert isinstance(platform.procs, dict)
    for name in ("restart", "serving"):
        assert callable(getattr(platform, name)) and hasattr(Supervised, name)


def test_the_supervisor_does_not_import_the_launcher():
    probe = "import sys, pdserve.cli.supervisor; print('pdserve.cli.launcher' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"
