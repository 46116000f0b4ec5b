"""`pdserve decode --role both`: the flag, and the defaults a worker that decodes and
prefills for others gets (its steps are its streams' ITL, so they are bounded)."""
from __future__ import annotations

import argparse

import pytest

import pdserve.cli.main
import pdserve.services.decode.main
from pdserve.services.worker.config import DEFAULT_MAX_STEP_MS, worker_config_from_args


def _config(*argv: str):
    parser = argparse.ArgumentParser()
    pdserve.services.decode.main.add_arguments(parser)
    args = parser.parse_args(list(argv))
    return args.role, worker_config_from_args(args)


def test_a_both_worker_bounds_its_steps_at_the_interactive_itl_target_and_keeps_the_decode_defaults():
    role, cfg = _config("--role", "both")
    decode_role, decode = _config()
    assert (role, decode_role) == ("both", "decode")
    assert cfg.engine.scheduler.max_step_ms == DEFAULT_MAX_STEP_MS["both"] == 100
    assert decode.engine.scheduler.max_step_ms == 0
    assert cfg.engine.scheduler.scheduling_policy == decode.engine.scheduler.scheduling_policy == "srpt"
    assert cfg.kv_write_finished and decode.kv_write_finished
    spec = '{"method": "ngram", "num_speculative_tokens": 2}'
    assert _config("--role", "both", "--speculative-config", spec)[1].engine.speculative_config is not None


def test_its_defaults_are_flags():
    assert _config("--role", "both", "--max-step-ms", "40")[1].engine.scheduler.max_step_ms == 40
    assert _config("--role", "both", "--no-chunked-prefill")[1].engine.scheduler.max_step_ms == 0
    assert not _config("--role", "both", "--no-kv-write-finished")[1].kv_write_finished


def test_the_help_states_the_defaults(capsys):
    with pytest.raises(SystemExit):
        pdserve.cli.main.main(["decode", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--role {decode,both}" in out
    assert "except --max-step-ms 100" in out and "100 on workers of --role both" in out


@pytest.mark.parametrize("argv,message", [
    (["decode", "--role", "prefill"], "argument --role: invalid choice: 'prefill' (choose from"),
    (["decode", "--role", "nope"], "argument --role: invalid choice: 'nope'"),
    (["prefill", "--role", "both"], "unrecognized arguments: --role both"),
])
def test_a_bad_role_is_refused_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        pdserve.cli.main.main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err
