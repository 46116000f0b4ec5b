"""`pdserve up --kv-transport ucx` (or tcp): the kvstore serves UCX (or raw TCP frames), every
worker moves KV over it;
`--kvstore-backend mooncake`: a Mooncake master and store nodes start first, the kvstore
indexes what they hold, every worker moves KV to and from them."""
from __future__ import annotations

import pytest

from pdserve.cli.launcher import PlatformConfig, plan
from pdserve.cli.main import build_parser
from pdserve.cli.mooncake_procs import MooncakePlan


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_ucx_reaches_the_kvstore_and_every_worker():
    specs = {s.name: s.argv for s in plan(PlatformConfig(num_prefill=1, num_decode=2, kv_transport="ucx"), [0, 1])}
    assert _flag(specs["kvstore"], "--ucx-port") == "0"  # a free port; workers ask the kvstore for it
    for name in ("prefill-0", "decode-0", "decode-1"):
        assert _flag(specs[name], "--kvstore-transport") == "ucx"


def test_tcp_reaches_the_kvstore_and_every_worker():
    specs = {s.name: s.argv for s in plan(PlatformConfig(num_prefill=1, num_decode=2, kv_transport="tcp"), [0, 1])}
    assert _flag(specs["kvstore"], "--tcp-port") == "0" and "--ucx-port" not in specs["kvstore"]
    for name in ("prefill-0", "decode-0", "decode-1"):
        assert _flag(specs[name], "--kvstore-transport") == "tcp"


def test_tcp_is_the_default_and_grpc_serves_no_port_of_its_own():
    specs = {s.name: s.argv for s in plan(PlatformConfig(), [0, 1])}
    assert _flag(specs["kvstore"], "--tcp-port") == "0" and "--ucx-port" not in specs["kvstore"]
    assert _flag(specs["prefill-0"], "--kvstore-transport") == "tcp"
    specs = {s.name: s.argv for s in plan(PlatformConfig(kv_transport="grpc"), [0, 1])}
    assert "--ucx-port" not in specs["kvstore"] and "--tcp-port" not in specs["kvstore"]
    assert _flag(specs["prefill-0"], "--kvstore-transport") == "grpc"


@pytest.mark.parametrize("flag", ["--kv-transport", "--kvstore-transport"])  # the workers' name works too
@pytest.mark.parametrize("transport", ["ucx", "tcp", "grpc"])
def test_the_up_command_takes_the_flag(flag, transport):
    args = build_parser().parse_args(["up", flag, transport])
    assert args.kv_transport == transport
    assert build_parser().parse_args(["up"]).kv_transport is None  # PlatformConfig's default: tcp


def test_mooncake_starts_a_master_and_a_store_node_per_replica_before_the_kvstore():
    cfg = PlatformConfig(num_prefill=1, num_decode=1, kvstore_backend="mooncake", kvstore_capacity_bytes=100 << 20,
                         mooncake=MooncakePlan(base_port=41000, replicas=2))
    specs = {s.name: s for s in plan(cfg, [0, 1])}
    master, nodes = specs["mooncake-master"], [specs["store-0"], specs["store-1"]]
    assert (master.stage, master.health, master.address) == (-1, "tcp", "127.0.0.1:41000")
    assert "--rpc_port=41000" in master.argv and "--http_metadata_server_port=41001" in master.argv
    assert [(n.stage, n.health, n.address) for n in nodes] == [(0, "tcp", "127.0.0.1:41003"),
                                                                (0, "tcp", "127.0.0.1:41005")]
    assert all(f"--global_segment_size={100 << 20}" in n.argv for n in nodes)
    kvstore = specs["kvstore"].argv
    assert "--tcp-port" not in kvstore  # the bytes move over Mooncake's transfer engine
    assert _flag(kvstore, "--backend") == "mooncake" and _flag(kvstore, "--mooncake-master") == "127.0.0.1:41000"
    assert _flag(kvstore, "--mooncake-replicas") == "2"
    assert int(_flag(kvstore, "--capacity-bytes")) < 100 << 20  # the index evicts before Mooncake does
    for name in ("prefill-0", "decode-0"):
        assert _flag(specs[name].argv, "--kvstore-transport") == "mooncake"
    assert specs["kvstore"].stage == 1 and specs["router"].stage == 2
    assert all(s.env["GLOG_minloglevel"] == "1" for s in specs.values())
    # the workers beside the nodes move bytes through them (shared memory): the kvstore names
    # them to the workers, and the nodes copy by memcpy
    assert [kvstore[i + 1] for i, a in enumerate(kvstore) if a == "--mooncake-store-node"] == \
        ["127.0.0.1:41003", "127.0.0.1:41005"]
    assert all(n.env["MC_STORE_MEMCPY"] == "1" for n in nodes)
    assert all("MC_STORE_MEMCPY" not in specs[name].env for name in ("mooncake-master", "kvstore", "decode-0"))


def test_the_memory_backend_starts_no_mooncake():
    specs = {s.name: s for s in plan(PlatformConfig(kvstore_capacity_bytes=64 << 20), [0, 1])}
    assert set(specs) == {"kvstore", "prefill-0", "decode-0", "router"}
    assert _flag(specs["kvstore"].argv, "--capacity-bytes") == str(64 << 20)
    assert "GLOG_minloglevel" not in specs["kvstore"].env


@pytest.mark.parametrize("argv, message", [
    (["--kvstore-replicas", "2"], "--kvstore-replicas: only with --kvstore-backend mooncake"),
    (["--kvstore-backend", "mooncake", "--kv-transport", "ucx"], "--kv-transport"),
    (["--kvstore-backend", "mooncake", "--kvstore-transport", "tcp"], "--kv-transport"),
    (["--kvstore-backend", "mooncake", "--kv-transport", "grpc"], "--kv-transport"),
    (["--kvstore-backend", "mooncake", "--kvstore-replicas", "9"], "--kvstore-replicas"),
])
def test_up_refuses_mooncake_flags_that_disagree(argv, message):
    args = build_parser().parse_args(["up", *argv])
    with pytest.raises(ValueError, match=message):
        args.func(args)
