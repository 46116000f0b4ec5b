"""`pdserve up --speculative-config`: checked before anything starts, then passed to the
decode workers (colocated ones too), never to the prefill workers."""
from __future__ import annotations

import argparse
import json

import pytest

import pdserve.cli.main
import pdserve.cli.up
from pdserve.cli.launcher import PlatformConfig, plan
from pdserve.engine.spec_decode.config import SpeculativeConfig
from pdserve.services.worker.config import add_worker_arguments, worker_config_from_args

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'


def _planned(monkeypatch, *argv: str) -> PlatformConfig:
    seen = []
    monkeypatch.setattr(pdserve.cli.up, "run_platform", lambda cfg: seen.append(cfg) or 0)
    assert pdserve.cli.main.main(["up", *argv]) == 0
    return seen[0]


def _flag(argv: list[str]) -> str | None:
    return argv[argv.index("--speculative-config") + 1] if "--speculative-config" in argv else None


def test_decode_workers_get_it_prefill_workers_do_not(monkeypatch):
    cfg = _planned(monkeypatch, "--prefill", "1", "--decode", "2", "--speculative-config", NGRAM,
                   "--worker-args=--no-chunked-prefill")
    specs = {s.name: s.argv for s in plan(cfg, [0, 1, 2])}
    assert _flag(specs["prefill-0"]) is None
    for name in ("decode-0", "decode-1"):
        assert "--no-chunked-prefill" in specs[name]
        parser = argparse.ArgumentParser()
        add_worker_arguments(parser, default_port=0)
        parsed = worker_config_from_args(parser.parse_args(specs[name][specs[name].index("pdserve.cli.main") + 2:]))
        assert parsed.engine.speculative_config == SpeculativeConfig("ngram", 4, prompt_lookup_max=3)


def test_colocated_decode_workers_get_it(monkeypatch):
    cfg = _planned(monkeypatch, "--prefill", "0", "--decode", "1", "--speculative-config",
                   '{"method": "draft_model", "model": "smollm2", "num_speculative_tokens": 3}')
    (decode,) = [s.argv for s in plan(cfg, [0]) if s.name == "decode-0"]
    assert json.loads(_flag(decode)) == {"method": "draft_model", "model": "smollm2", "num_speculative_tokens": 3,
                                         "prompt_lookup_min": 1, "prompt_lookup_max": 4, "disable_by_batch_size": 0}


def test_without_it_no_worker_gets_the_flag(monkeypatch):
    cfg = _planned(monkeypatch)
    assert all(_flag(s.argv) is None for s in plan(cfg, [0, 1]))


def test_a_bad_config_stops_up_before_anything_starts(monkeypatch, capsys):
    monkeypatch.setattr(pdserve.cli.up, "run_platform", lambda cfg: pytest.fail("started"))
    with pytest.raises(SystemExit) as e:
        pdserve.cli.main.main(["up", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 99}'])
    assert e.value.code == 2
    assert "argument --speculative-config: speculative_config.num_speculative_tokens" in capsys.readouterr().err
