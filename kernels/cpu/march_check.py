"""Runs tests against the CPU kernels built for another CPU than this one.

The kernels compile with -march=native, and their sources choose an AVX-512 path or a plain
C++ path by what the compiler targets. On an AVX-512 machine the plain path is therefore
never compiled, and AVX2 machines run code the tests here have not seen. This builds the
library for the given -march, into a cache directory of its own, loads it in this process in
place of the native build, and runs pytest on the given tests against it:

    .venv/bin/python -m pdserve.kernels.cpu.march_check --march x86-64-v3 \
        tests/kernels/test_cpu_skinny_linear.py tests/engine/test_correctness_tiny.py

x86-64-v3 is AVX2 + FMA without AVX-512. The exit status is pytest's (2 when the build fails).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], usage="%(prog)s [--march M] [--extensions-dir D] TESTS... [PYTEST FLAGS]")
    p.add_argument("--march", default="x86-64-v3", help="the compiler's -march for the build (default: x86-64-v3)")
    p.add_argument("--extensions-dir", default=None,
                   help="the build cache for this -march (default: a folder under the temp dir named by it)")
    # everything else (test paths, -q, -k ...) is pytest's
    args, pytest_args = p.parse_known_args(argv)
    if not pytest_args:
        p.error("name the tests to run (e.g. tests/kernels/test_cpu_skinny_linear.py)")
    # torch reads the cache directory when it builds: set before kernels.cpu.build loads anything
    os.environ["TORCH_EXTENSIONS_DIR"] = args.extensions_dir or os.path.join(
        tempfile.gettempdir(), f"pdserve-kernels-march-{args.march}")

    from pdserve.kernels.cpu import build
    # the flag is swapped here, not made a setting of build.py: only this check needs another
    # target (pods build on their own node), and load_library() is one build per process anyway
    build.CFLAGS[build.CFLAGS.index("-march=native")] = f"-march={args.march}"
    try:
        path = build.load_library()  # cached: every later load in this process gets this build
    except build.CpuKernelBuildError as e:
        print(e, file=sys.stderr)
        return 2
    print(f"kernels built for -march={args.march}: {path}", flush=True)

    import pytest
    return int(pytest.main(["-p", "no:cacheprovider", *pytest_args]))


if __name__ == "__main__":
    sys.exit(main())
