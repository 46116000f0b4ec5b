"""decode.speculativeConfig: rendered as the decode workers' --speculative-config JSON, which
the worker's own flag parser accepts; refused on the prefill pool and when malformed."""
from __future__ import annotations

import argparse
import json

import pytest

from pdserve.engine.spec_decode.config import SpeculativeConfig
from pdserve.services.worker.config import add_worker_arguments, worker_config_from_args
from tests.deploy.chart import FULLNAME, container, render, render_error

FLAG = "--speculative-config="
SCHEMA = "values don't meet the specifications of the schema"
DRAFT = ("decode.speculativeConfig.method=draft_model", "decode.speculativeConfig.model=/models/draft",
         "decode.speculativeConfig.num_speculative_tokens=3", "decode.speculativeConfig.disable_by_batch_size=32")


def _spec_args(sets: tuple[str, ...], role: str) -> list[str]:
    args = container(render(sets=sets).get("Deployment", f"{FULLNAME}-{role}"))["args"]
    return [a for a in args if a.startswith(FLAG)]


def _worker_parses(arg: str) -> SpeculativeConfig:
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser, default_port=0)
    return worker_config_from_args(parser.parse_args([arg])).engine.speculative_config


def test_off_by_default():
    assert _spec_args((), "decode") == [] and _spec_args((), "prefill") == []


def test_the_decode_pool_gets_the_flag_and_the_worker_parses_it():
    (arg,) = _spec_args(DRAFT, "decode")
    assert json.loads(arg.removeprefix(FLAG)) == {"method": "draft_model", "model": "/models/draft",
                                                  "num_speculative_tokens": 3, "disable_by_batch_size": 32}
    assert _worker_parses(arg) == SpeculativeConfig("draft_model", 3, model="/models/draft",
                                                    disable_by_batch_size=32)
    assert _spec_args(DRAFT, "prefill") == []  # a pool's value, never the other's


def test_ngram_renders_integers_not_floats():
    sets = ("decode.speculativeConfig.method=ngram", "decode.speculativeConfig.num_speculative_tokens=4",
            "decode.speculativeConfig.prompt_lookup_max=4")
    (arg,) = _spec_args(sets, "decode")
    assert arg == FLAG + '{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_max":4}'
    assert _worker_parses(arg).prompt_lookup_max == 4


@pytest.mark.parametrize("sets,where", [
    (("decode.speculativeConfig.method=eagle", "decode.speculativeConfig.num_speculative_tokens=2"),
     "/decode/speculativeConfig/method"),
    (("decode.speculativeConfig.method=ngram", "decode.speculativeConfig.num_speculative_tokens=0"),
     "/decode/speculativeConfig/num_speculative_tokens"),
    (("decode.speculativeConfig.method=ngram",), "/decode/speculativeConfig"),   # no k
    (("decode.speculativeConfig.num_speculative_tokenz=3",), "'num_speculative_tokenz'"),
])
def test_the_schema_refuses(sets, where):
    error = render_error(*sets)
    assert SCHEMA in error and where in error, error


def test_the_prefill_pool_refuses_it_with_a_message():
    error = render_error("prefill.speculativeConfig.method=ngram", "prefill.speculativeConfig.num_speculative_tokens=4")
    assert "prefill.speculativeConfig: prefill workers do not speculate" in error, error
