"""A child process's exit status as a person reads it: `pdserve up`'s supervisor logs its
processes' exits with it, the multi-process executor names a dead rank with it. Pure (no
torch), so the CLI imports it without the engine."""
from __future__ import annotations

import signal


def killed_by(code: int) -> str | None:
    """The signal behind Popen's negative returncode ('SIGKILL', or 'signal 99' for one this
    platform has no name for); None for a process that exited by itself."""
    if code >= 0:
        return None
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def describe_exit(code: int) -> str:
    """'code 1', 'code -9, killed by SIGKILL'."""
    name = killed_by(code)
    return f"code {code}" if name is None else f"code {code}, killed by {name}"
