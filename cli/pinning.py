"""CPU affinity for the processes `pdserve up` starts."""
from __future__ import annotations

import os


def pin_process(pid: int, cpus: list[int]) -> None:
    """Pins a process just started to `cpus`, every thread it has (Popen returns once it has
    exec'd, before a Python child has imported anything, so that is its main thread). Done from
    here, not by a preexec_fn: forking with one from a process that runs threads (this one's
    output pumps; pytest's) can deadlock or abort the child. A child already gone is left to
    the supervisor, which sees it exit."""
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            os.sched_setaffinity(int(tid), cpus)
    except (FileNotFoundError, ProcessLookupError):
        pass
