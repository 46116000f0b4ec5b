"""Running a service process until SIGINT/SIGTERM: the `run(args)` of every service CLI."""
from __future__ import annotations

import logging
import os
import signal
import threading


def configure_logging(name: str) -> None:
    logging.basicConfig(level=os.environ.get("PDSERVE_LOG_LEVEL", "INFO"),
                        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s")


def set_cpu_threads(threads: int | None) -> None:
    """Give this worker its share of the CPU, as a pod gets its own GPU."""
    if threads:
        import torch
        torch.set_num_threads(threads)


def wait_for_shutdown(done: threading.Event | None = None) -> None:
    """Until SIGINT or SIGTERM, or `done` is set (the process's own reason to stop). A
    signal never sets `done`: the caller tells a drain (signal) from a failure (`done`)."""
    signalled = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: signalled.set())
    while not signalled.is_set() and not (done is not None and done.is_set()):
        signalled.wait(0.2)
