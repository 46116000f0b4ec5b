"""`pdserve up --kv-transport ucx`: the kvstore serves UCX, every worker moves KV over it."""
from __future__ import annotations

from cli.launcher import PlatformConfig, plan
from cli.main import build_parser


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_ucx_reaches_the_kvstore_and_every_worker():
    specs = {s.name: s.argv for s in plan(PlatformConfig(num_prefill=1, num_decode=2, kv_transport="ucx"), [0, 1])}
    assert _flag(specs["kvstore"], "--ucx-port") == "0"  # a free port; workers ask the kvstore for it
    for name in ("prefill-0", "decode-0", "decode-1"):
        assert _flag(specs[name], "--kvstore-transport") == "ucx"


def test_grpc_is_the_default_and_serves_no_ucx():
    specs = {s.name: s.argv for s in plan(PlatformConfig(), [0, 1])}
    assert "--ucx-port" not in specs["kvstore"]
    assert _flag(specs["prefill-0"], "--kvstore-transport") == "grpc"


def test_the_up_command_takes_the_flag():
    args = build_parser().parse_args(["up", "--kv-transport", "ucx"])
    assert args.kv_transport == "ucx"
