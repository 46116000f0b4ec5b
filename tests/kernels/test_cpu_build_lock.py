"""A process killed while it loads the C++ kernels must not leave every later load waiting
forever on torch's build lock (kernels/cpu/build.py: load_lock). Real processes: one dies by
SIGKILL inside both locks, as an OOM kill during a pod's start would; the next load finishes."""
from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.kernels.cpu import build

# what a loader does up to its death: our lock, then torch's lock file, then SIGKILL
DIE_INSIDE_THE_LOCKS = """
import os, signal, sys
from pathlib import Path
from torch.utils.file_baton import FileBaton
from pdserve.kernels.cpu import build
build_dir = Path(sys.argv[1])
with build.load_lock(build_dir):
    assert FileBaton(str(build_dir / build.TORCH_LOCK)).try_acquire()
    os.kill(os.getpid(), signal.SIGKILL)
"""

LOAD = "from pdserve.kernels.cpu import build; print(build.load_library())"


def test_a_load_after_a_loader_killed_inside_the_locks_finishes():
    build.load_library()  # built already (make setup); this test is about the lock, not the compile
    build_dir = build.build_directory()
    dead = subprocess.run([sys.executable, "-c", DIE_INSIDE_THE_LOCKS, str(build_dir)], capture_output=True)
    assert dead.returncode == -signal.SIGKILL, dead.stderr.decode()
    assert (build_dir / build.TORCH_LOCK).exists()  # what it left: torch would wait on this forever
    # torch polls the lock file every 0.1 s without end; a timeout here is the bug
    loaded = subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True, timeout=120)
    assert loaded.returncode == 0, loaded.stderr
    assert Path(loaded.stdout.strip()).name.startswith(build.library_name())
    assert "removing" in loaded.stderr and str(build_dir / build.TORCH_LOCK) in loaded.stderr
    assert not (build_dir / build.TORCH_LOCK).exists()


HOLD = """
import sys
from pathlib import Path
from pdserve.kernels.cpu import build
with build.load_lock(Path(sys.argv[1])):
    (Path(sys.argv[1]) / build.TORCH_LOCK).touch()
    print("in", flush=True)
    sys.stdin.readline()
    (Path(sys.argv[1]) / build.TORCH_LOCK).unlink()
"""

WAIT = """
import sys
from pathlib import Path
from pdserve.kernels.cpu import build
print("ready", flush=True)
with build.load_lock(Path(sys.argv[1])):
    print("got it", flush=True)
"""


def test_a_live_holder_is_waited_for_not_robbed(tmp_path):
    """The lock file is removed only by whoever holds our lock, so never from under a loader
    that is alive inside torch's lock: a second process waits for the first to let go."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    waiter = None
    try:
        assert holder.stdout.readline().strip() == "in"
        waiter = subprocess.Popen([sys.executable, "-c", WAIT, str(tmp_path)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        assert waiter.stdout.readline().strip() == "ready"
        with pytest.raises(subprocess.TimeoutExpired):  # still waiting: the holder is alive
            waiter.wait(timeout=2)
        assert (tmp_path / build.TORCH_LOCK).exists()
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.wait(timeout=30) == 0
        out, err = waiter.communicate(timeout=60)
        assert out.strip() == "got it" and "removing" not in err  # the holder cleaned up after itself
    finally:
        for process in (holder, waiter):
            if process is not None and process.poll() is None:
                process.kill()
