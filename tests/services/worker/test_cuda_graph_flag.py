"""--cuda-graph-batch-sizes: parsed into the engine config, which checks it."""
from __future__ import annotations

import argparse

import pytest

from pdserve.services.worker.config import add_worker_arguments, worker_config_from_args


def _config(*argv: str):
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser, default_port=0)
    return worker_config_from_args(parser.parse_args(list(argv)))


def test_batch_sizes_reach_the_engine_config():
    cfg = _config("--device", "cuda", "--attention-backend", "triton", "--cuda-graph-batch-sizes", "1,2,4,8")
    assert cfg.engine.cuda_graph_batch_sizes == (1, 2, 4, 8)
    assert _config().engine.cuda_graph_batch_sizes == ()


def test_bad_batch_sizes_are_refused_naming_the_flag_or_field(capsys):
    with pytest.raises(SystemExit):
        _config("--cuda-graph-batch-sizes", "1,x")
    assert "--cuda-graph-batch-sizes" in capsys.readouterr().err
    with pytest.raises(ValueError, match="cuda_graph_batch_sizes: CUDA graphs need device 'cuda'"):
        _config("--cuda-graph-batch-sizes", "1,2")  # the default device is the CPU
