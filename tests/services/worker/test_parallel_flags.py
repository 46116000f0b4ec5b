"""--tensor-parallel-size / --pipeline-parallel-size / --pipeline-layer-split /
--collective-timeout-s: into EngineConfig.parallel, and a bad value refused naming its flag,
on the workers and on `pdserve generate` alike."""
from __future__ import annotations

import argparse

import pytest

import pdserve.cli.main
from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.executor.config import ParallelConfig
from pdserve.services.worker.config import add_worker_arguments, worker_config_from_args


def _config(*argv: str):
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser, default_port=0)
    return worker_config_from_args(parser.parse_args(list(argv)))


def test_defaults_are_the_engines():
    assert _config().engine.parallel == ParallelConfig()


def test_flags_reach_the_engine_config():
    parallel = _config("--tensor-parallel-size", "3", "--pipeline-parallel-size", "2",
                       "--pipeline-layer-split", "20,10", "--collective-timeout-s", "12.5").engine.parallel
    assert parallel == ParallelConfig(tensor_parallel_size=3, pipeline_parallel_size=2, pipeline_layer_split=(20, 10),
                                      collective_timeout_s=12.5)
    assert parallel.world_size == 6


def test_short_aliases():
    parallel = _config("-tp", "3", "-pp=2").engine.parallel
    assert (parallel.tensor_parallel_size, parallel.pipeline_parallel_size) == (3, 2)


@pytest.mark.parametrize("argv,flag", [
    (("--tensor-parallel-size", "0"), "--tensor-parallel-size/-tp"),
    (("-tp", "two"), "--tensor-parallel-size/-tp"),
    (("--pipeline-parallel-size", "-1"), "--pipeline-parallel-size/-pp"),
    (("--pipeline-layer-split", "20,x"), "--pipeline-layer-split"),
    (("--pipeline-layer-split", "20,0"), "--pipeline-layer-split"),
    (("--collective-timeout-s", "0"), "--collective-timeout-s"),
    (("--collective-timeout-s", "nan"), "--collective-timeout-s"),
])
def test_a_bad_value_is_refused_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        _config(*argv)
    assert e.value.code == 2
    assert f"argument {flag}: " in capsys.readouterr().err


def test_a_split_that_does_not_match_the_stages_names_the_flag():
    with pytest.raises(InvalidRequestError, match=r"^--pipeline-layer-split: .*2 pipeline stages, got \(30,\)"):
        _config("--pipeline-parallel-size", "2", "--pipeline-layer-split", "30")


def test_generate_passes_the_flags_to_the_llm(monkeypatch, capsys):
    from pdserve import engine
    seen = {}

    class FakeLLM:  # the engine's own parallel runs are the executor's tests; here: what generate passes
        def __init__(self, **kwargs):
            seen.update(kwargs)
            raise InvalidRequestError("model", "stop here")
    monkeypatch.setattr(engine, "LLM", FakeLLM)
    code = pdserve.cli.main.main(["generate", "--prompt", "hi", "-tp", "3", "--pipeline-parallel-size", "2",
                          "--pipeline-layer-split", "16,14", "--collective-timeout-s", "9"])
    assert code == 2 and "model: stop here" in capsys.readouterr().err
    assert {k: seen[k] for k in ("tensor_parallel_size", "pipeline_parallel_size", "pipeline_layer_split",
                                 "collective_timeout_s")} == {"tensor_parallel_size": 3, "pipeline_parallel_size": 2,
                                                              "pipeline_layer_split": (16, 14),
                                                              "collective_timeout_s": 9.0}


def test_generate_refuses_a_bad_split_naming_the_flag(monkeypatch, capsys):
    from pdserve import engine
    monkeypatch.setattr(engine, "LLM", lambda **_: pytest.fail("an engine was built"))
    assert pdserve.cli.main.main(["generate", "--prompt", "hi", "-pp", "3", "--pipeline-layer-split", "10,20"]) == 2
    assert "pdserve: error: --pipeline-layer-split: " in capsys.readouterr().err
    with pytest.raises(SystemExit):
        pdserve.cli.main.main(["generate", "--prompt", "hi", "-tp", "0"])
    assert "argument --tensor-parallel-size/-tp: must be an integer >= 1, got '0'" in capsys.readouterr().err
