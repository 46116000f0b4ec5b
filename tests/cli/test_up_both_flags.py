"""`pdserve up --both N`: workers of both roles, planned as `pdserve decode --role both` and
listed in both of the router's pools; combinations that make no sense are refused naming
the flag, before any process starts."""
from __future__ import annotations

import pytest

import pdserve.cli.main
import pdserve.cli.up
from pdserve.cli.launcher import PlatformConfig, plan


def _planned(monkeypatch, *argv: str) -> PlatformConfig:
    seen = []
    monkeypatch.setattr(pdserve.cli.up, "run_platform", lambda cfg: seen.append(cfg) or 0)
    assert pdserve.cli.main.main(["up", *argv]) == 0
    return seen[0]


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_both_alone_starts_only_workers_of_both_roles_in_both_pools(monkeypatch):
    cfg = _planned(monkeypatch, "--both", "2", "--worker-base-port", "7200")
    assert (cfg.num_prefill, cfg.num_decode, cfg.num_both) == (0, 0, 2)
    specs = {s.name: s for s in plan(cfg, [0, 1])}
    assert list(specs) == ["kvstore", "both-0", "both-1", "router"]
    for name, cpus in (("both-0", [0]), ("both-1", [1])):
        argv = specs[name].argv
        assert argv[argv.index("pdserve.cli.main") + 1:argv.index("pdserve.cli.main") + 4] == ["decode", "--role", "both"]
        assert specs[name].cpus == cpus
    router = specs["router"].argv
    assert _flag(router, "--prefill") == _flag(router, "--decode") == "127.0.0.1:7200,127.0.0.1:7201"


def test_both_beside_pure_workers(monkeypatch):
    cfg = _planned(monkeypatch, "--both", "1", "--prefill", "1", "--decode", "1", "--worker-base-port", "7200",
                   "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}')
    specs = {s.name: s for s in plan(cfg, [0, 1, 2])}
    assert list(specs) == ["kvstore", "prefill-0", "decode-0", "both-0", "router"]
    router = specs["router"].argv
    assert _flag(router, "--prefill") == "127.0.0.1:7200,127.0.0.1:7202"
    assert _flag(router, "--decode") == "127.0.0.1:7201,127.0.0.1:7202"
    assert "--speculative-config" in specs["both-0"].argv  # it decodes: the decode workers' flags
    assert "--speculative-config" not in specs["prefill-0"].argv
    # without --both, the defaults as before
    default = _planned(monkeypatch)
    assert (default.num_prefill, default.num_decode, default.num_both) == (1, 1, 0)


@pytest.mark.parametrize("argv,message", [
    (["--both", "-1"], "--both: must be >= 0, got -1"),
    (["--both", "x"], "argument --both: invalid int value: 'x'"),
    (["--both", "2", "--path-policy", "colocated"], "--both: a worker of both roles is there to serve the prefill"),
    (["--both", "1", "--autoscale"], "--both: not with --autoscale"),
    (["--prefill", "1", "--decode", "0"], "--decode: needs at least one worker that decodes (--decode or --both)"),
    (["--both", "0", "--decode", "0"], "--decode: needs at least one worker that decodes"),
    (["--both", "1", "--decode", "-1"], "--decode: must be >= 0, got -1"),
    (["--prefill", "-2"], "--prefill: must be >= 0, got -2"),
])
def test_a_combination_that_makes_no_sense_is_refused_naming_the_flag(monkeypatch, capsys, argv, message):
    monkeypatch.setattr(pdserve.cli.up, "run_platform", lambda cfg: pytest.fail("started with a bad combination"))
    try:
        code = pdserve.cli.main.main(["up", *argv])
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    assert code == 2
    assert message in capsys.readouterr().err
