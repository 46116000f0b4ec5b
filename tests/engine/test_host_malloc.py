"""keep_freed_memory (engine/worker/host_malloc.py): a CPU engine's per-step temporaries reuse
freed memory instead of being faulted in anew. Measured in child processes (the setting is
per process and lasts), by the kernel's count of page faults."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pdserve.engine.worker.host_malloc import keep_freed_memory

# "plain": glibc's default mmap threshold (128 KiB) set explicitly. Left to itself glibc raises
# the threshold to the size of each mmapped chunk freed, so whether the control faults depends on
# the order of the process's earlier frees and trims (it did not, once, in a full suite run:
# 13,312 faults); fixed, every temporary is a fresh mapping, as in an engine whose step sizes
# keep changing.
CHILD = """
import ctypes, json, resource, sys, torch
from pdserve.engine.worker.host_malloc import M_MMAP_THRESHOLD, keep_freed_memory
if sys.argv[1] == "tuned":
    tuned = keep_freed_memory()
else:
    tuned = None
    assert ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, 128 * 1024) == 1
def step(i):  # a step's temporaries: sizes that vary with the batch (8-24 MiB), alive together
    n = (2 + i % 5) << 20
    a = torch.ones(n); b = torch.ones(n // 2); c = a * 2; d = torch.ones(3 << 20)
    return float(c.sum() + b.sum() + d.sum())
for i in range(5):  # warm: the first steps fault their memory in either way
    step(i)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for i in range(40):
    step(i)
print(json.dumps({"faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, "tuned": tuned}))
"""


def faults_in_child(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc is Linux's")
def test_step_temporaries_reuse_memory_once_tuned():
    plain, tuned = faults_in_child("plain"), faults_in_child("tuned")
    assert tuned["tuned"] is True
    smallest_step_pages = (8 << 20) // 4096
    assert plain["faults"] > 40 * smallest_step_pages  # glibc maps and zeroes the temporaries anew
    assert tuned["faults"] * 20 < plain["faults"]      # kept: reused without faults


def test_tuning_is_idempotent():
    assert keep_freed_memory() == keep_freed_memory()
