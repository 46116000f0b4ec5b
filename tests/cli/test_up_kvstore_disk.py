"""`pdserve up --kvstore-disk-dir`: the kvstore gets its disk tier (--disk-dir, absolute, and
--disk-capacity-bytes); the two flags go together, and with the memory backend only."""
from __future__ import annotations

import os

import pytest

from pdserve.cli.launcher import PlatformConfig, plan
from pdserve.cli.main import build_parser
from pdserve.cli.up import run


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_the_kvstore_gets_its_disk_tier():
    cfg = PlatformConfig(kvstore_disk_dir="/var/kv", kvstore_disk_capacity_bytes=16 << 30)
    kvstore = {s.name: s.argv for s in plan(cfg, [0, 1])}["kvstore"]
    assert (_flag(kvstore, "--disk-dir"), _flag(kvstore, "--disk-capacity-bytes")) == ("/var/kv", str(16 << 30))
    assert "--disk-dir" not in {s.name: s.argv for s in plan(PlatformConfig(), [0, 1])}["kvstore"]


def test_the_up_command_takes_the_flags():
    args = build_parser().parse_args(["up", "--kvstore-disk-dir", "kv", "--kvstore-disk-capacity-bytes", "2GiB"])
    assert (args.kvstore_disk_dir, args.kvstore_disk_capacity_bytes) == ("kv", 2 << 30)


@pytest.mark.parametrize("argv,message", [
    (["--kvstore-disk-dir", "kv"], "--kvstore-disk-dir: goes with --kvstore-disk-capacity-bytes"),
    (["--kvstore-disk-capacity-bytes", "1GiB"], "--kvstore-disk-dir: goes with --kvstore-disk-capacity-bytes"),
    (["--kvstore-disk-dir", "kv", "--kvstore-disk-capacity-bytes", "1GiB", "--kvstore-backend", "mooncake"],
     "--kvstore-disk-dir: a disk tier is for --kvstore-backend memory only"),
])
def test_disk_flags_that_do_not_go_together_stop_up_before_any_process(argv, message, monkeypatch):
    monkeypatch.setattr("pdserve.cli.up.run_platform", lambda cfg: pytest.fail("a platform was started"))
    with pytest.raises(ValueError, match=message):
        run(build_parser().parse_args(["up", *argv]))


def test_a_relative_folder_reaches_the_kvstore_absolute(monkeypatch):
    started = []
    monkeypatch.setattr("pdserve.cli.up.run_platform", lambda cfg: started.append(cfg) or 0)
    run(build_parser().parse_args(["up", "--kvstore-disk-dir", "kv", "--kvstore-disk-capacity-bytes", "1GiB"]))
    assert started[0].kvstore_disk_dir == os.path.abspath("kv")
