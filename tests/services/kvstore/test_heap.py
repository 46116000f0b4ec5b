"""heap.keep_freed_memory, in a process of its own (it changes that process's allocator):
block-sized buffers freed and allocated again on a thread, as the TCP server's connection
threads do with a put's blocks, fault no fresh page after the first round."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

_ROUNDS = """
import resource, sys, threading
from pdserve.services.kvstore import heap
tuned = heap.keep_freed_memory(1 << 30) if sys.argv[1] == "tuned" else None
faults = []

def rounds():
    for _ in range(4):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        blocks = [bytearray(737280) for _ in range(64)]  # a 1k-token put of SmolLM2's blocks
        for block in blocks:
            block[::4096] = b"x" * len(range(0, len(block), 4096))  # the bytes landing: every page
        del blocks
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
thread = threading.Thread(target=rounds)
thread.start()
thread.join()
print(tuned, *faults)
"""


def _faults(mode: str) -> tuple[str, list[int]]:
    out = subprocess.run([sys.executable, "-c", _ROUNDS, mode], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                         capture_output=True, text=True, timeout=60, check=True).stdout.split()
    return out[0], [int(n) for n in out[1:]]


def test_freed_block_memory_is_reused_without_page_faults():
    tuned, faults = _faults("tuned")
    assert tuned == "True"  # glibc here
    assert faults[0] > 10_000  # 47 MB touched for the first time: 11.5k pages
    assert max(faults[1:]) < 500, faults  # then the same memory again
