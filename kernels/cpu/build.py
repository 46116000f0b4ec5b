"""Builds and loads the C++ CPU kernels (`pdserve_cpu_kernels`), once per process.

torch.utils.cpp_extension.load compiles with ninja into torch's extension cache
(TORCH_EXTENSIONS_DIR, by default ~/.cache/torch_extensions) and reuses the build while
the sources and flags are unchanged, so loading an already built library takes well
under a second. The library's name carries a digest of its sources and flags: two checkouts
or versions of pdserve sharing one cache each keep their own build, and neither loads the
other's (an older build lacks newer ops). `make setup` runs `python -m pdserve.kernels.cpu.build` to build it ahead of use.

Every load, even of a library already built, passes through torch's build lock: a file
`lock` in the build directory, made on entry and removed on exit. A process killed in
between (an OOM kill while compiling at a pod's start, a kill -9) leaves the file behind,
and every later load waits for it forever, silently. So loads here first take a lock of
their own, a flock the kernel releases when its holder dies: whoever holds it knows no
other pdserve process is inside torch's lock, and removes a file left by a dead one.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
from pathlib import Path

import torch
from torch.utils import cpp_extension

BASE_NAME = "pdserve_cpu_kernels"
SOURCES = [str(Path(__file__).with_name(name))
           for name in ("paged_attention.cpp", "fused_ops.cpp", "skinny_linear.cpp", "gguf_linear.cpp")]
HEADERS = [str(Path(__file__).with_name(name)) for name in ("skinny_rows.h",)]  # in the digest: sources include them
# ATen's parallel_for is header code over OpenMP (torch's CPU parallel backend): without
# -fopenmp it runs serially. The library then needs libgomp.so.1, which torch has loaded
# already, so kernels and torch share one thread pool.
CFLAGS = ["-O3", "-march=native", "-fopenmp"]
LDFLAGS = ["-fopenmp"]
TORCH_LOCK = "lock"             # torch's FileBaton, in the build directory
LOAD_LOCK = "pdserve.flock"     # ours, beside it

logger = logging.getLogger(__name__)


def library_name() -> str:
    digest = hashlib.sha256(" ".join(CFLAGS + LDFLAGS).encode())
    for source in SOURCES + HEADERS:
        digest.update(Path(source).read_bytes())
    return f"{BASE_NAME}_{digest.hexdigest()[:12]}"


class CpuKernelBuildError(RuntimeError):
    pass


@functools.cache
def load_library() -> str:
    """Builds (if needed) and loads the kernels, registering torch.ops.pdserve.*; returns the
    library's path. Raises CpuKernelBuildError, saying what failed, when it cannot."""
    name = library_name()
    try:
        build_dir = build_directory()
        with _ninja_on_path(), load_lock(build_dir):
            # copies: torch appends to the flag lists it is given, which would change library_name()
            path = cpp_extension.load(name=name, sources=SOURCES, extra_cflags=list(CFLAGS),
                                      extra_ldflags=list(LDFLAGS), is_python_module=False, verbose=False,
                                      build_directory=str(build_dir))
    except Exception as e:  # compiler, ninja or link failure: say so, never fall back silently
        raise CpuKernelBuildError(
            f"building the C++ CPU kernels ({BASE_NAME}: {', '.join(SOURCES)}) failed: {e}\n"
            "They need a C++ compiler (g++) and ninja (`pip install ninja`). The pure torch "
            "reference needs neither: use attention_backend='torch' (--attention-backend torch)."
        ) from e
    return str(path)


def build_directory() -> Path:
    """Where torch builds the library: its own choice (TORCH_EXTENSIONS_DIR or its default),
    named so that the directory load_lock locks is the one torch builds in."""
    return Path(cpp_extension._get_build_directory(library_name(), verbose=False))


@contextlib.contextmanager
def load_lock(build_dir: Path):
    """Held while torch builds or loads the library in `build_dir`: one pdserve process at a
    time, and none inside torch's lock unless it holds this one. Holding it, a torch lock
    file found is a dead loader's, and is removed (see the module's docstring)."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / LOAD_LOCK, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = build_dir / TORCH_LOCK
            if stale.exists():
                logger.warning("removing %s: torch's build lock, left by a process that died while it "
                               "built or loaded the CPU kernels", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def _ninja_on_path():
    """cpp_extension runs `ninja` from PATH; the pip package's binary sits in the venv's bin,
    which is not on PATH when the venv's python runs without activation (as in `make`)."""
    try:
        import ninja
    except ImportError:  # a system ninja may still be on PATH; cpp_extension reports if not
        yield
        return
    old = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, old])
    try:
        yield
    finally:
        os.environ["PATH"] = old


def main() -> None:
    path = load_library()
    print(f"built {library_name()} (torch {torch.__version__}): {path}")


if __name__ == "__main__":
    main()
