"""`pdserve kvstore --disk-dir`: its flags go together and with the memory backend only; a
real process killed with SIGKILL and started again on the same folder serves the full
blocks it had written, byte for byte (its folder 0700, its files 0600); its tails and
leases are gone. A folder it cannot fence is refused, naming the flag."""
from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import time

import pytest

from pdserve.services.kvstore.client import KVStoreClient
from pdserve.services.kvstore.stores.disk_files import SUFFIX
from pdserve.services.kvstore.main import run
from pdserve.services.kvstore.server import KVStoreConfig
from tests.services.kvstore.conftest import h, wire_block
from tests.services.kvstore.test_main import ROOT, _read_line, parser

NAMES = (b"a", b"b", b"c")


def test_the_disk_flags_default_to_memory_only():
    args = parser().parse_args(["--disk-dir", "/d", "--disk-capacity-bytes", "64GiB"])
    assert (args.disk_dir, args.disk_capacity_bytes) == ("/d", 64 << 30)
    assert (parser().parse_args([]).disk_dir, KVStoreConfig().disk_dir) == (None, None)


@pytest.mark.parametrize("argv,message", [
    (["--disk-dir", "/d"], "--disk-dir: goes with --disk-capacity-bytes"),
    (["--disk-capacity-bytes", "1GiB"], "--disk-dir: goes with --disk-capacity-bytes"),
    (["--disk-dir", "/d", "--disk-capacity-bytes", "1GiB", "--backend", "redis://127.0.0.1:1/0"],
     "--disk-dir: a disk tier is for --backend memory only"),
])
def test_disk_flags_that_do_not_go_together_name_the_flag(argv, message, capsys):
    assert run(parser().parse_args(["--port", "0", *argv])) == 2
    assert message in capsys.readouterr().err


def test_a_bad_disk_size_names_its_flag(capsys):
    with pytest.raises(SystemExit):
        parser().parse_args(["--disk-capacity-bytes", "lots"])
    assert "argument --disk-capacity-bytes:" in capsys.readouterr().err


@pytest.mark.parametrize("overrides", [{"disk_dir": "/d"}, {"disk_capacity_bytes": 1 << 30},
                                       {"disk_dir": "/d", "disk_capacity_bytes": 1, "backend": "redis://r:6379/0"}])
def test_config_refuses_a_disk_tier_it_cannot_run(overrides):
    with pytest.raises(ValueError, match="^disk_dir:"):
        KVStoreConfig(**overrides)


def _argv(disk_dir) -> list[str]:
    return [sys.executable, "-m", "pdserve.services.kvstore.main", "--port", "0", "--capacity-bytes", "1MiB",
            "--disk-dir", str(disk_dir), "--disk-capacity-bytes", "1MiB"]


def _start(disk_dir) -> tuple[subprocess.Popen, str, str]:
    """The process, its address and its banner."""
    proc = subprocess.Popen(_argv(disk_dir), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    banner = _read_line(proc)
    return proc, re.search(r"serving on (\S+),", banner).group(1), banner


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)
    proc.stdout.close()
    proc.stderr.close()


def _wait_for_files(disk_dir, n: int, timeout_s: float = 10.0) -> None:
    """The writer is in the background: wait until n block files are there."""
    deadline = time.monotonic() + timeout_s
    while sum(name.endswith(SUFFIX) for name in os.listdir(disk_dir)) < n:
        assert time.monotonic() < deadline, f"the disk tier wrote fewer than {n} blocks: {os.listdir(disk_dir)}"
        time.sleep(0.02)


def test_a_killed_kvstore_finds_its_blocks_on_disk_again(tmp_path):
    disk_dir = tmp_path / "kv"
    proc, address, banner = _start(disk_dir)
    try:
        assert "disk " in banner and "(0 blocks" in banner
        client = KVStoreClient(address)
        try:
            lease = client.create_lease(10_000)
            blocks = [wire_block(name, fill=i + 1) for i, name in enumerate(NAMES)]
            assert client.put([*blocks, wire_block(tail="req/tail")], lease_id=lease) == 4
        finally:
            client.close()
        _wait_for_files(disk_dir, len(NAMES))
        proc.kill()  # SIGKILL: no shutdown, no flush, the lease never released
        proc.wait(timeout=10)
    finally:
        _stop(proc)
    assert stat.S_IMODE(os.stat(disk_dir).st_mode) == 0o700
    assert {stat.S_IMODE(e.stat().st_mode) for e in os.scandir(disk_dir)} == {0o600}

    proc, address, banner = _start(disk_dir)
    try:
        assert f"({len(NAMES)} blocks" in banner
        client = KVStoreClient(address)
        try:
            assert client.lookup([h(name) for name in NAMES]) == len(NAMES)
            got = client.get([h(name) for name in NAMES], ["req/tail"])
            assert [b.found for b in got] == [True, True, True, False]  # tails are never written
            assert [b.data for b in got[:3]] == [b.data for b in blocks]
            assert [b.header for b in got[:3]] == [b.header for b in blocks]
            assert client.stats().num_pinned_blocks == 0  # leases do not survive
        finally:
            client.close()
    finally:
        _stop(proc)


@pytest.mark.parametrize("change,problem", [
    (lambda d: os.chmod(d, 0o777), "mode 0777: writable by group and others; chmod 700 it"),
    (lambda d: os.chown(d, 1234, 1234), f"owned by uid 1234, not this process's {os.geteuid()}"),
], ids=["writable by others", "another uid's"])
def test_a_kvstore_refuses_a_folder_it_cannot_fence_naming_the_flag(tmp_path, change, problem):
    disk_dir = tmp_path / "kv"
    disk_dir.mkdir(mode=0o700)
    change(disk_dir)
    done = subprocess.run(_argv(disk_dir), cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert f"pdserve kvstore: error: --disk-dir {disk_dir}: {problem}" in done.stderr, done.stderr
    assert os.listdir(disk_dir) == []


def test_a_kvstore_tightens_the_0755_folder_an_older_version_made(tmp_path):
    disk_dir = tmp_path / "kv"
    disk_dir.mkdir(mode=0o755)
    os.chmod(disk_dir, 0o755)
    proc, _, banner = _start(disk_dir)
    try:
        assert "(0 blocks" in banner
        assert stat.S_IMODE(os.stat(disk_dir).st_mode) == 0o700
        proc.kill()
        proc.wait(timeout=10)
        assert "was mode 0755, readable by others" in proc.stderr.read()
    finally:
        _stop(proc)
