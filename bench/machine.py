"""The machine a benchmark ran on, as its result records it: which vector and matrix units
the CPU has decides which kernels run (AVX2 on one machine, AVX-512 or AMX on another)."""
from __future__ import annotations

CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16")


def cpu_flags(cpuinfo: str) -> dict:
    """The model name and the vector/matrix flags the kernels care about, from /proc/cpuinfo's text."""
    flags: set[str] = set()
    model = ""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags" and not flags:
            flags = set(value.split())
        elif key.strip() == "model name" and not model:
            model = value.strip()
    found = {name: name in flags for name in CPU_FLAGS}
    found["amx"] = sorted(f for f in flags if f.startswith("amx"))  # amx_tile, amx_bf16, amx_int8: empty = none
    return {"model_name": model, **found}


def read_cpu_flags() -> dict:
    try:
        with open("/proc/cpuinfo") as f:
            return cpu_flags(f.read())
    except OSError:
        return {}
