"""triton_kernels: Triton paged attention (decode, prefill) and the KV-cache write against
their torch references, float32 and bfloat16 (bench/gpu_kernels.py's checks)."""
from __future__ import annotations

import argparse

from bench.gpu_check.context import Ctx, free


def run(ctx: Ctx):
    """bench/gpu_kernels.py's correctness checks (its GPU shapes; on CPU its small ones in the
    interpreter), float32 and bfloat16, with a float32 tolerance of 2e-4 (its own 2e-2 is for
    half precision)."""
    import torch

    import bench.gpu_kernels as gk
    from pdserve.kernels import cache_ops, paged_attention
    tolerance = {torch.float32: 2e-4, torch.bfloat16: 2e-2}
    rows: list[dict] = []
    dtype_now = {}

    def report(name, out, ref) -> bool:
        tol = tolerance[dtype_now["dtype"]]
        err = (out.float() - ref.float()).abs().max().item()
        ok = bool(torch.allclose(out.float(), ref.float(), atol=tol, rtol=tol))
        rows.append({"dtype": str(dtype_now["dtype"]).removeprefix("torch."), "check": name, "max_err": err, "ok": ok})
        print(f"  {rows[-1]['dtype']:<9} {name:<52} max|err| {err:.2e}  {'ok' if ok else 'MISMATCH'}", flush=True)
        return ok
    gk.report_check = report  # run_checks reports through it
    device = torch.device(ctx.device)
    small = argparse.Namespace(small=not ctx.cuda)
    for dtype in (torch.float32, torch.bfloat16):
        dtype_now["dtype"] = dtype
        torch.manual_seed(0)
        gk.run_checks(paged_attention, cache_ops, small, dtype, device)
        free()
    parts = []
    for name in ("float32", "bfloat16"):
        mine = [r for r in rows if r["dtype"] == name]
        good = sum(r["ok"] for r in mine)
        parts.append(f"{name} {good}/{len(mine)} (max|err| {max(r['max_err'] for r in mine):.1e})")
    bad = [f"{r['dtype']} {r['check']}" for r in rows if not r["ok"]]
    where = torch.cuda.get_device_name() if ctx.cuda else "CPU, Triton interpreter, small shapes"
    detail = f"{', '.join(parts)} on {where}" + (f"; mismatches: {'; '.join(bad[:4])}" if bad else "")
    return ("PASS" if rows and not bad else "FAIL"), detail, {"checks": rows, "device": where}
