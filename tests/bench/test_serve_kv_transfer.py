"""bench/serve_kv_transfer.py on a few blocks: the Mooncake paths, a worker elsewhere (TCP)
and one beside the store node (shared memory), each moving the bytes bit-exact (the bench
asserts it) with either seal (XXH3 checksums; AES-256-GCM, issue 49) and reporting its line
against raw TCP. No timing is asserted."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _bench(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, GLOG_minloglevel="2", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "bench.serve_kv_transfer", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_both_mooncake_paths_move_the_payload_and_report_against_raw_tcp():
    done = _bench("--num-blocks", "4", "--repeats", "1", "--paths", "mooncake,mooncake-local")
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    remote, local = "kvstore mooncake over mooncake", \
        "kvstore mooncake over mooncake (the store node on this host: shared memory)"
    assert [(line["path"], line.get("seal")) for line in lines] == [
        ("raw loopback TCP (send + echo)", None), (remote, "xxh3"), (remote, "aes-gcm"), (local, "xxh3"),
        (local, "aes-gcm")]
    for line in lines[1:]:
        assert line["put_mb_s"] > 0 and line["get_mb_s"] > 0 and line["ratio_vs_raw_socket"] > 0
        assert {"index_ms", "put_transfer_ms", "get_transfer_ms", "register_ms"} <= set(line)


def test_an_unknown_path_or_seal_is_named():
    done = _bench("--paths", "mooncake-remote")
    assert done.returncode == 2 and "--paths: ['mooncake-remote']" in done.stderr
    done = _bench("--seals", "crc32")
    assert done.returncode == 2 and "--seals: ['crc32']" in done.stderr
