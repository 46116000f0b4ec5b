from __future__ import annotations

from bench.machine import cpu_flags


def test_cpu_flags_read_the_first_processor():
    cpuinfo = ("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum\n"
               "flags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n\n"
               "processor\t: 1\nmodel name\t: other\nflags\t\t: fpu\n")
    assert cpu_flags(cpuinfo) == {"model_name": "Intel(R) Xeon(R) Platinum", "avx2": True, "avx512f": True,
                                        "avx512_bf16": True, "amx": ["amx_bf16", "amx_int8", "amx_tile"]}
    assert cpu_flags("flags\t: fpu avx2\n") == {"model_name": "", "avx2": True, "avx512f": False,
                                                      "avx512_bf16": False, "amx": []}
