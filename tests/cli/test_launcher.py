"""`pdserve up`: the process plan, and the real thing started, used and stopped."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

from cli.launcher import PlatformConfig, plan, split_cpus
from tests.services.security.procs import free_ports


def test_cores_are_split_among_workers():
    assert split_cpus([0, 1], 2, None) == [[0], [1]]
    assert split_cpus([0, 1, 2, 3], 3, None) == [[0], [1], [2]]
    assert split_cpus([0, 1, 2, 3], 2, None) == [[0, 1], [2, 3]]
    assert split_cpus([0, 1], 3, 1) == [[0], [1], [0]]
    assert split_cpus([0, 1, 2, 3], 1, 2) == [[0, 1]]


def test_plan_wires_workers_to_kvstore_and_router():
    specs = plan(PlatformConfig(model="m", num_prefill=2, num_decode=1, router_port=7000, kvstore_port=7100,
                                worker_base_port=7200, metrics_base_port=7300), [0, 1, 2])
    names = [s.name for s in specs]
    assert names == ["kvstore", "prefill-0", "prefill-1", "decode-0", "router"]
    router = specs[-1].argv
    assert router[router.index("--prefill") + 1] == "127.0.0.1:7200,127.0.0.1:7201"
    assert router[router.index("--decode") + 1] == "127.0.0.1:7202"
    for worker in specs[1:4]:
        assert worker.argv[worker.argv.index("--kvstore") + 1] == "127.0.0.1:7100"
        assert worker.argv[worker.argv.index("--threads") + 1] == "1" and len(worker.cpus) == 1
    assert len({s.metrics_port for s in specs}) == len(specs)


def test_plan_without_prefill_workers_is_colocated():
    specs = plan(PlatformConfig(model="m", num_prefill=0, num_decode=2, worker_args=("--no-chunked-prefill",)),
                 [0, 1])
    assert [s.name for s in specs] == ["kvstore", "decode-0", "decode-1", "router"]
    assert "--prefill" not in specs[-1].argv
    assert [s.cpus for s in specs[1:3]] == [[0], [1]]
    assert all(s.argv[-1] == "--no-chunked-prefill" for s in specs[1:3])


def test_up_serves_requests_and_stops_everything_on_ctrl_c(tiny_llama_dir):
    router, kvstore, metrics, http = free_ports(4)
    workers = free_ports(2)
    cmd = [sys.executable, "-m", "cli.main", "up", "--model", tiny_llama_dir, "--port", str(router),
           "--kvstore-port", str(kvstore), "--http-port", str(http), "--worker-base-port", str(min(workers)),
           "--metrics-base-port", str(metrics), "--short-prompt-tokens", "8"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines = []
    try:
        deadline = time.monotonic() + 240
        for line in proc.stdout:
            lines.append(line)
            if "pdserve is up" in line or time.monotonic() > deadline:
                break
        assert any("pdserve is up" in line for line in lines), "".join(lines)
        out = subprocess.run([sys.executable, "-m", "cli.main", "generate", "--url", f"127.0.0.1:{router}",
                              "--model", tiny_llama_dir, "--prompt", "a long enough prompt to need prefill",
                              "--max-tokens", "5", "--json"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert '"finish_reason"' in out.stdout
        import urllib.request
        models = urllib.request.urlopen(f"http://127.0.0.1:{http}/v1/models", timeout=10).read().decode()
        assert '"object":"list"' in models.replace(" ", "")
    finally:
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
    lines.append(rest)
    log = "".join(lines)
    assert proc.returncode == 0, log
    for name in ("kvstore", "prefill-0", "decode-0", "router"):
        assert f"[{name:>9}]" in log
    children = subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert children == [], f"processes left behind: {children}"
