"""The machine a benchmark ran on, as its result records it: which vector and matrix units
the CPU has decides which kernels run (AVX2 on one machine, AVX-512 or AMX on another).

A cloud VM often masks the model name ("AMD EPYC"), and two VMs of one kind can sit on hosts
of different generations: the family and model numbers tell them apart (AMD family 25
model 16-31 is Zen 4, family 26 Zen 5), and so does `avx_vnni` (VEX-encoded VNNI, which
Zen 5 and recent Intel cores have and Zen 4 lacks; llama.cpp builds use it)."""
from __future__ import annotations

CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni")


def cpu_flags(cpuinfo: str) -> dict:
    """The model name, family and model numbers and the vector/matrix flags the kernels care
    about, from /proc/cpuinfo's text (its first processor)."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    found = {name: name in flags for name in CPU_FLAGS}
    found["amx"] = sorted(f for f in flags if f.startswith("amx"))  # amx_tile, amx_bf16, amx_int8: empty = none
    return {"model_name": fields.get("model name", ""), "family": _number(fields.get("cpu family")),
            "model": _number(fields.get("model")), **found}


def _number(text: str | None) -> int | None:
    return int(text) if text and text.isdigit() else None


def read_cpu_flags() -> dict:
    try:
        with open("/proc/cpuinfo") as f:
            return cpu_flags(f.read())
    except OSError:
        return {}
