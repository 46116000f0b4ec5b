"""A recorded autoscaling run: `pdserve up --autoscale` under a burst of long prompts.

Starts the platform (1 prefill + 1 decode worker, the tiny test model by default, the
chart's HPAs with the windows of bench/autoscale_values.yaml), waits a few idle seconds,
sends a burst of long prompts (`--burst-rate` req/s for `--burst-s`, at most
`--concurrency` in flight; they all take the prefill path), then stays idle until the
prefill pool is back at minReplicas. It records every decision the controller logs, the
workers it started, served with and drained, and each request's TTFT; writes the plot
(cli/bench/autoscale_plot.py), the records as JSON and the decision log, and prints one
JSON summary line. Exits non-zero if a request failed or the pool did not grow and shrink.

    .venv/bin/python -m bench.autoscale_run [--model PATH --burst-rate 10 --burst-s 100
        --plot docs/img/autoscale_run.png --result-dir /tmp/pdserve-bench/autoscale]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.report import emit_result
from pdserve.cli.bench.arrivals import ArrivalConfig
from pdserve.cli.bench.autoscale_plot import PoolSample, autoscale_timeline
from pdserve.cli.bench.datasets import DatasetConfig, LengthDist
from pdserve.cli.bench.local_platform import free_port_range
from pdserve.cli.bench.main import BenchConfig, run_bench
from pdserve.cli.bench.targets import TargetConfig

REPO = Path(__file__).resolve().parents[1]

DECISION = re.compile(r"autoscale t=[\d.]+s pool=(\w+) current=(\d+) metric=(\S+) target=(\S+) raw=\d+ "
                      r"desired=(\d+) reason=")
EVENT = re.compile(r"autoscale: (?:(\w+)-\d+ serving on|draining (\w+)-\d+|stopped (\w+)-\d+ before)")


class Recorder:
    """`pdserve up`'s output, each line stamped on this process's clock."""

    def __init__(self, proc: subprocess.Popen, log_path: str):
        self.proc, self.lines = proc, []
        self._log = open(log_path, "w")
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.perf_counter(), line.rstrip("\n")))
            self._log.write(line)
            self._log.flush()

    def wait_for(self, pattern: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(re.search(pattern, line) for _, line in self.lines):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"no {pattern!r} in `pdserve up`'s output (see {self._log.name})")
            time.sleep(0.2)

    def samples(self, t0: float, initial_serving: dict[str, int]) -> list[PoolSample]:
        """Each decision, with the pool's serving workers at that moment (started ones once
        they serve; a draining one no longer counts: the router stops choosing it)."""
        serving, out = dict(initial_serving), []
        for stamp, line in list(self.lines):
            if m := EVENT.search(line):
                if m.group(1):
                    serving[m.group(1)] = serving.get(m.group(1), 0) + 1
                elif m.group(2):
                    serving[m.group(2)] -= 1
            elif m := DECISION.search(line):
                pool, current, metric, target, desired = m.groups()
                out.append(PoolSample(stamp - t0, pool, int(current), int(desired), serving.get(pool, 0),
                                      None if metric == "none" else float(metric), float(target)))
        return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: the tiny random Llama of the tests (built in a temp dir)")
    p.add_argument("--values", default=str(REPO / "bench" / "autoscale_values.yaml"))
    p.add_argument("--sync-s", type=float, default=2.0)
    p.add_argument("--prompt-len", type=int, default=400)
    p.add_argument("--burst-rate", type=float, default=10.0)
    p.add_argument("--burst-s", type=float, default=100.0)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--idle-before-s", type=float, default=10.0)
    p.add_argument("--max-idle-after-s", type=float, default=120.0)
    p.add_argument("--plot", default=str(REPO / "docs" / "img" / "autoscale_run.png"))
    p.add_argument("--result-dir", default="/tmp/pdserve-bench/autoscale")
    args = p.parse_args()
    os.makedirs(args.result_dir, exist_ok=True)
    model = args.model
    if model is None:
        from tests.models import build_tiny_llama
        model = build_tiny_llama(Path(tempfile.mkdtemp(prefix="pdserve-tiny-")))
    router, workers, metrics = free_port_range(2), free_port_range(2), free_port_range(4)
    cmd = [sys.executable, "-m", "pdserve.cli.main", "up", "--model", model, "--prefill", "1", "--decode", "1",
           "--port", str(router), "--kvstore-port", str(router + 1), "--http-port", "off",
           "--worker-base-port", str(workers), "--metrics-base-port", str(metrics),
           "--path-policy", "threshold", "--short-prompt-tokens", "32",
           "--autoscale", "--autoscale-values", args.values, "--autoscale-sync-s", str(args.sync_s)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=dict(os.environ, PDSERVE_LOG_LEVEL="WARNING"))
    rec = Recorder(proc, os.path.join(args.result_dir, "pdserve-up.log"))
    try:
        rec.wait_for("pdserve is up", timeout_s=300)
        t0 = time.perf_counter()
        time.sleep(args.idle_before_s)
        n = round(args.burst_rate * args.burst_s)
        result = run_bench(BenchConfig(
            target=TargetConfig("grpc", f"127.0.0.1:{router}", timeout_s=300),
            dataset=DatasetConfig("random", num_requests=n, input_len=LengthDist(args.prompt_len),
                                  output_len=LengthDist(4), seed=1),
            arrivals=ArrivalConfig("burst", rate=0.0, burst_rate=args.burst_rate, on_s=args.burst_s,
                                   off_s=args.burst_s, burst_poisson=False, max_concurrency=args.concurrency),
            label="autoscale", progress=False), quiet=True)
        burst_start = t0 + args.idle_before_s
        deadline = time.monotonic() + args.max_idle_after_s
        while time.monotonic() < deadline:  # idle until the pool is back at its minimum
            done = [s for s in rec.samples(t0, {"prefill": 1, "decode": 1}) if s.pool == "prefill"]
            if done and done[-1].desired == 1 and any(s.desired > 1 for s in done) and done[-1].serving == 1:
                break
            time.sleep(1.0)
        time.sleep(3 * args.sync_s)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
    samples = [s for s in rec.samples(t0, {"prefill": 1, "decode": 1})]
    shift = burst_start - t0  # the plot's zero: the burst's start
    records = [r for r in result.records]
    samples = [PoolSample(s.time_s - shift, s.pool, s.current, s.desired, s.serving, s.metric, s.target)
               for s in samples]
    os.makedirs(os.path.dirname(args.plot), exist_ok=True)
    autoscale_timeline(records, samples, args.plot, title=f"({os.cpu_count()} cores, tiny model)")
    log_lines = [line for _, line in rec.lines if "autoscale" in line]
    Path(args.result_dir, "decisions.log").write_text("\n".join(log_lines) + "\n")
    Path(args.result_dir, "records.json").write_text(json.dumps([r.to_json() for r in records]))
    prefill = [s for s in samples if s.pool == "prefill"]
    summary = {"requests": len(records), "failed": result.summary["failed"],
               "max_prefill_replicas": max(s.desired for s in prefill),
               "final_prefill_replicas": prefill[-1].desired, "plot": args.plot,
               "ttft_p50_s": (result.summary.get("ttft_s") or {}).get("p50"),
               "ttft_p90_s": (result.summary.get("ttft_s") or {}).get("p90"), "result_dir": args.result_dir}
    emit_result(summary)
    ok = summary["failed"] == 0 and summary["max_prefill_replicas"] > 1 and summary["final_prefill_replicas"] == 1
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
