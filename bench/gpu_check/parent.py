"""The parent: the preflight, the model, then each check in its own process within its
budget and the run's --time-limit-s; one CHECK line per check and gpu_check.json."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from bench.gpu_check.checks import CHECKS, Check
from bench.gpu_check.model import SMOLLM2_SHAPE, TINY_SHAPE, build_random_llama, describe_model
from bench.gpu_check.preflight import carry_hint, cuda_status, missing_packages
from bench.gpu_check.processes import child_env, kill_group

TIME_LIMIT_S = 450
MIN_CHECK_S = 20          # a check with less time left than this is skipped


def run_check(check: Check, args, model: str, work: str, log_dir: str, timeout_s: float) -> dict:
    """Runs one check in its own process (its own session, killed whole past `timeout_s`);
    the result it wrote, or a FAIL saying how it ended."""
    result_path = os.path.join(work, f"{check.name}.json")
    log_path = os.path.join(log_dir, f"{check.name}.log")
    device = "cpu" if args.cpu_logic or args.dry_run else "cuda"
    cmd = [sys.executable, "-m", "bench.gpu_check", "--child", check.name, "--model", model, "--device", device,
           "--result", result_path, "--work", work]
    env = child_env({"TRITON_INTERPRET": "1"} if device == "cpu" else None)
    start = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = None
        finally:  # past the budget, or Ctrl-C here: nothing the check started may outlive it
            kill_group(proc.pid)
            proc.wait()
            sessions = os.path.join(work, f"{check.name}.sessions")  # e.g. its `pdserve up`, a session of its own
            if os.path.exists(sessions):
                for line in open(sessions).read().split():
                    kill_group(int(line))
    seconds = round(time.monotonic() - start, 1)
    if code is None:
        return {"status": "FAIL", "detail": f"timed out after {seconds:.0f} s (budget {timeout_s:.0f} s); "
                                            f"log {log_path}", "seconds": seconds}
    if os.path.exists(result_path):
        with open(result_path) as f:
            result = json.load(f)
        return {**result, "seconds": seconds}
    return {"status": "FAIL", "detail": f"exited with code {code} without a result: {last_line(log_path)}",
            "seconds": seconds}


def last_line(path: str) -> str:
    try:
        lines = [line.strip() for line in open(path, errors="replace") if line.strip()]
    except OSError:
        return "(no log)"
    return lines[-1][:300] if lines else "(empty log)"


def one_line(text: str) -> str:
    return " ".join(str(text).split())


def parent_main(args) -> int:
    if args.list:
        for c in CHECKS:
            where = "cpu dry run + GPU" if c.cpu_dry_run else "GPU only"
            print(f"{c.name:<28} budget {c.budget_s:>3} s  {where:<17}  {c.summary}")
        print(f"whole run: at most {args.time_limit_s:.0f} s (--time-limit-s)")
        return 0
    try:
        available, versions = cuda_status()
    except ImportError as e:
        print(f"gpu_check: torch does not import ({e}): this script checks the GPU path and needs torch with CUDA",
              file=sys.stderr)
        return 2
    if not available and not (args.dry_run or args.cpu_logic):
        print(f"gpu_check: no CUDA device ({versions}): this script checks the GPU path and runs only on a "
              f"CUDA machine (--dry-run runs what it can on CPU)", file=sys.stderr)
        return 2
    if args.dry_run and args.cpu_logic:
        print("gpu_check: --dry-run and --cpu-logic exclude each other", file=sys.stderr)
        return 2
    problems = missing_packages()
    if problems:
        print(f"gpu_check: missing or unusable Python packages: {'; '.join(problems)}. {carry_hint()}",
              file=sys.stderr)
        return 2
    mode = "dry run on CPU" if args.dry_run else "CPU logic run (not a GPU result)" if args.cpu_logic else "CUDA"
    if args.dry_run and available:
        mode = "dry run (CUDA is available: the kernels still run on CPU)"
    run_start = time.monotonic()
    out = os.path.abspath(args.out) if args.out else None
    work = tempfile.mkdtemp(prefix="gpu_check-")
    log_dir = os.path.join(out, "gpu_check_logs") if out else os.path.join(work, "logs")
    os.makedirs(log_dir, exist_ok=True)
    shape = TINY_SHAPE if (args.dry_run or args.cpu_logic) else SMOLLM2_SHAPE
    results = []
    try:
        model = args.model
        build_s = 0.0
        if model is None:
            start = time.monotonic()
            model = build_random_llama(os.path.join(work, "model"), shape)
            build_s = time.monotonic() - start
        print(f"gpu_check: {mode}; {versions}; {describe_model(args.model, shape)}"
              f"{f' (built in {build_s:.1f} s)' if not args.model else ''}; logs in {log_dir}", flush=True)
        for check in CHECKS:
            if check.name not in args.only:
                continue
            left = args.time_limit_s - (time.monotonic() - run_start)
            if args.dry_run and not check.cpu_dry_run:
                result = {"status": "SKIP", "detail": "needs CUDA (dry run on CPU)", "seconds": 0.0}
            elif left < MIN_CHECK_S and not args.cpu_logic:
                result = {"status": "SKIP", "detail": f"out of time: {left:.0f} s of --time-limit-s "
                                                      f"{args.time_limit_s:.0f} left", "seconds": 0.0}
            else:
                budget = check.budget_s * (20 if args.cpu_logic else 1)
                result = run_check(check, args, model, work, log_dir, budget if args.cpu_logic else min(budget, left))
            results.append({"name": check.name, **result})
            print(f"CHECK {check.name} {result['status']} {one_line(result['detail'])}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    passed = sum(r["status"] == "PASS" for r in results)
    failed = sum(r["status"] == "FAIL" for r in results)
    skipped = sum(r["status"] == "SKIP" for r in results)
    total_s = time.monotonic() - run_start
    note = f", {skipped} skipped" if skipped else ""
    if args.dry_run:
        note += " (dry run on CPU: the GPU-only checks were skipped)"
    print(f"gpu_check: {passed} passed, {failed} failed{note} in {total_s:.0f} s", flush=True)
    if out:
        with open(os.path.join(out, "gpu_check.json"), "w") as f:
            json.dump({"mode": mode, "versions": versions, "model": args.model or describe_model(None, shape),
                       "checks": results, "passed": passed, "failed": failed, "skipped": skipped,
                       "seconds": round(total_s, 1)}, f, indent=1)
    ok = failed == 0 and (skipped == 0 or args.dry_run)
    return 0 if ok else 1

