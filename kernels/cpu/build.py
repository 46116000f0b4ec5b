"""Builds and loads the C++ CPU kernels (`pdserve_cpu_kernels`), once per process.

torch.utils.cpp_extension.load compiles with ninja into torch's extension cache
(TORCH_EXTENSIONS_DIR, by default ~/.cache/torch_extensions) and reuses the build while
the sources and flags are unchanged, so loading an already built library takes well
under a second. The library's name carries a digest of its sources and flags: two checkouts
or versions of pdserve sharing one cache each keep their own build, and neither loads the
other's (an older build lacks newer ops). `make setup` runs `python -m kernels.cpu.build` to build it ahead of use.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import os
from pathlib import Path

import torch
from torch.utils import cpp_extension

BASE_NAME = "pdserve_cpu_kernels"
SOURCES = [str(Path(__file__).with_name(name)) for name in ("paged_attention.cpp", "fused_ops.cpp")]
# ATen's parallel_for is header code over OpenMP (torch's CPU parallel backend): without
# -fopenmp it runs serially. The library then needs libgomp.so.1, which torch has loaded
# already, so kernels and torch share one thread pool.
CFLAGS = ["-O3", "-march=native", "-fopenmp"]
LDFLAGS = ["-fopenmp"]


def library_name() -> str:
    digest = hashlib.sha256(" ".join(CFLAGS + LDFLAGS).encode())
    for source in SOURCES:
        digest.update(Path(source).read_bytes())
    return f"{BASE_NAME}_{digest.hexdigest()[:12]}"


class CpuKernelBuildError(RuntimeError):
    pass


@functools.cache
def load_library() -> str:
    """Builds (if needed) and loads the kernels, registering torch.ops.pdserve.*; returns the
    library's path. Raises CpuKernelBuildError, saying what failed, when it cannot."""
    try:
        with _ninja_on_path():
            # copies: torch appends to the flag lists it is given, which would change library_name()
            path = cpp_extension.load(name=library_name(), sources=SOURCES, extra_cflags=list(CFLAGS),
                                      extra_ldflags=list(LDFLAGS), is_python_module=False, verbose=False)
    except Exception as e:  # compiler, ninja or link failure: say so, never fall back silently
        raise CpuKernelBuildError(
            f"building the C++ CPU kernels ({BASE_NAME}: {', '.join(SOURCES)}) failed: {e}\n"
            "They need a C++ compiler (g++) and ninja (`pip install ninja`). The pure torch "
            "reference needs neither: use attention_backend='torch' (--attention-backend torch)."
        ) from e
    return str(path)


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
