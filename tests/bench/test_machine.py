from __future__ import annotations

from bench.machine import cpu_flags


def test_cpu_flags_read_the_first_processor():
    cpuinfo = ("processor\t: 0\ncpu family\t: 6\nmodel\t\t: 143\nmodel name\t: Intel(R) Xeon(R) Platinum\n"
               "flags\t\t: fpu sse avx2 avx512f avx512_bf16 avx512_vnni avx_vnni amx_bf16 amx_tile amx_int8\n\n"
               "processor\t: 1\ncpu family\t: 25\nmodel\t\t: 1\nmodel name\t: other\nflags\t\t: fpu\n")
    assert cpu_flags(cpuinfo) == {"model_name": "Intel(R) Xeon(R) Platinum", "family": 6, "model": 143,
                                  "avx2": True, "avx512f": True, "avx512_bf16": True, "avx512_vnni": True,
                                  "avx_vnni": True, "amx": ["amx_bf16", "amx_int8", "amx_tile"]}


def test_a_vm_with_a_masked_name_is_told_apart_by_family_model_and_flags():
    # Zen 4 as a VM shows it: the name masked, AVX-512 VNNI but no VEX-encoded VNNI
    zen4 = "cpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\nflags\t: avx2 avx512f avx512_bf16 avx512_vnni\n"
    assert cpu_flags(zen4) == {"model_name": "AMD EPYC", "family": 25, "model": 17, "avx2": True, "avx512f": True,
                               "avx512_bf16": True, "avx512_vnni": True, "avx_vnni": False, "amx": []}
    assert cpu_flags("flags\t: fpu avx2\n") == {"model_name": "", "family": None, "model": None, "avx2": True,
                                                "avx512f": False, "avx512_bf16": False, "avx512_vnni": False,
                                                "avx_vnni": False, "amx": []}
