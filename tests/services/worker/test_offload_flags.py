"""--kv-offloading-size (vLLM's flag, GiB): into EngineConfig.cache.kv_offloading_bytes, off by
default, a bad value refused naming the flag, and an engine with a host tier of that size;
`pdserve up --kv-offloading-size` reaches every worker of both pools."""
from __future__ import annotations

import argparse

import pytest

import pdserve.cli.main
import pdserve.cli.up
from pdserve.cli.launcher import PlatformConfig, plan
from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.worker.kv_cache import bytes_per_block
from pdserve.services.worker.config import add_worker_arguments, worker_config_from_args
from pdserve.services.worker.runtime import build_engine

GiB = 1 << 30


def _parse(*argv: str):
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser, default_port=0)
    return parser.parse_args(list(argv))


def _config(*argv: str):
    return worker_config_from_args(_parse(*argv))


def test_off_by_default():
    assert _config().engine.cache.kv_offloading_bytes is None
    assert _config("--kv-offloading-size", "0").engine.cache.kv_offloading_bytes is None


def test_gib_into_bytes():
    assert _config("--kv-offloading-size", "4").engine.cache.kv_offloading_bytes == 4 * GiB
    assert _config("--kv-offloading-size", "0.25").engine.cache.kv_offloading_bytes == GiB // 4


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "4GiB", ""])
def test_a_bad_value_is_refused_naming_the_flag(value, capsys):
    with pytest.raises(SystemExit) as e:
        _parse("--kv-offloading-size", value)
    assert e.value.code == 2
    assert "argument --kv-offloading-size: must be a number of GiB >= 0" in capsys.readouterr().err


def test_without_prefix_caching_it_is_refused_naming_the_flag():
    with pytest.raises(InvalidRequestError, match=r"^--kv-offloading-size: .*--no-prefix-caching"):
        _config("--kv-offloading-size", "1", "--no-prefix-caching")
    _config("--kv-offloading-size", "0", "--no-prefix-caching")  # off: nothing to refuse


def test_the_worker_engine_gets_a_host_tier_of_that_size(tiny_llama_dir, tiny):
    engine = build_engine(_config("--model", tiny_llama_dir, "--kv-offloading-size", "0.001",
                                  "--kv-cache-memory-bytes", str(1 << 20)), tiny)
    block = bytes_per_block(tiny.arch, 16, next(tiny.model.parameters()).dtype)
    assert engine.kv_manager.host.num_slots == int(0.001 * GiB) // block
    assert engine.stats().host.num_total_blocks == engine.kv_manager.host.num_slots > 0


def _planned(monkeypatch, *argv: str) -> dict[str, list[str]]:
    seen: list[PlatformConfig] = []
    monkeypatch.setattr(pdserve.cli.up, "run_platform", lambda cfg: seen.append(cfg) or 0)
    assert pdserve.cli.main.main(["up", *argv]) == 0
    return {s.name: s.argv[s.argv.index("pdserve.cli.main") + 2:] for s in plan(seen[0], [0, 1, 2])}


def test_pdserve_up_passes_it_to_every_worker(monkeypatch):
    specs = _planned(monkeypatch, "--prefill", "1", "--decode", "2", "--kv-offloading-size", "1.5")
    for name in ("prefill-0", "decode-0", "decode-1"):
        assert worker_config_from_args(_parse(*specs[name])).engine.cache.kv_offloading_bytes == int(1.5 * GiB)
    assert "--kv-offloading-size" not in specs["router"] and "--kv-offloading-size" not in specs["kvstore"]


def test_pdserve_up_leaves_it_off_by_default(monkeypatch):
    specs = _planned(monkeypatch)
    assert all("--kv-offloading-size" not in argv for argv in specs.values())


def test_pdserve_up_refuses_a_bad_value_before_anything_starts(monkeypatch, capsys):
    monkeypatch.setattr(pdserve.cli.up, "run_platform", lambda cfg: pytest.fail("the platform was started"))
    with pytest.raises(SystemExit):
        pdserve.cli.main.main(["up", "--kv-offloading-size", "-2"])
    assert "argument --kv-offloading-size: must be a number of GiB >= 0" in capsys.readouterr().err
