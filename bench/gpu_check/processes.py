"""The processes the checks start: the repository root on their PYTHONPATH, and a whole
process group killed at once."""
from __future__ import annotations

import os
import signal

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def child_env(extra: dict | None = None) -> dict:
    env = dict(os.environ, **(extra or {}))
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if ROOT not in paths:  # the platform's processes run `python -P -m pdserve.cli.main`: the root must be here
        paths.append(ROOT)
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass

