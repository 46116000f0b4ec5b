"""The C++ kernels' plain (non-AVX-512) paths, which an AVX-512 machine never compiles: built
for x86-64-v3 (AVX2 + FMA) by kernels/cpu/march_check.py in a child process, the kernel tests
pass against that build. Guards AVX2 users' build and results from a change tested only on
AVX-512 hosts."""
from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

KERNEL_TESTS = [str(Path(__file__).with_name(name)) for name in
                ("test_cpu_skinny_linear.py", "test_cpu_gguf_linear.py", "test_cpu_fused_ops.py",
                 "test_cpu_paged_attention.py")]


@pytest.mark.skipif(platform.machine() != "x86_64", reason="-march=x86-64-v3 names an x86-64 target")
def test_the_kernel_tests_pass_against_a_build_without_avx512(tmp_path_factory):
    # one build cache per pytest run's base temp dir: a fresh compile in CI, where it is the point
    ext_dir = tmp_path_factory.getbasetemp() / "kernels-x86-64-v3"
    run = subprocess.run([sys.executable, "-m", "pdserve.kernels.cpu.march_check", "--march", "x86-64-v3",
                          "--extensions-dir", str(ext_dir), "-q", *KERNEL_TESTS],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    built = run.stdout.split("kernels built for -march=x86-64-v3: ", 1)[1].split("\n", 1)[0]
    assert Path(built).is_relative_to(ext_dir)  # the tests ran against this build, not the native one
    assert " passed" in run.stdout and " failed" not in run.stdout
    # the build holds no 512-bit instruction: the plain paths, not the intrinsics, were tested
    assert b"zmm" not in subprocess.run(["objdump", "-d", built], capture_output=True, check=True).stdout
