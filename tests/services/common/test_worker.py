"""The worker command line: flags into WorkerConfig, WorkerConfig into the engine."""
from __future__ import annotations

import argparse

import torch

from engine.model.loader import load_model
from engine.model.source import resolve_model
from services.common.worker import add_worker_arguments, build_engine, worker_config_from_args


def _config(*argv: str):
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser, default_port=0)
    return worker_config_from_args(parser.parse_args(list(argv)))


def test_chunked_prefill_is_on_by_default_with_a_fixed_budget():
    cfg = _config()
    assert cfg.enable_chunked_prefill and cfg.max_num_batched_tokens == 2048


def test_no_chunked_prefill_leaves_the_budget_to_max_model_len():
    cfg = _config("--no-chunked-prefill")
    assert not cfg.enable_chunked_prefill and cfg.max_num_batched_tokens is None


def test_an_explicit_budget_is_kept_without_chunked_prefill():
    cfg = _config("--no-chunked-prefill", "--max-num-batched-tokens", "4096")
    assert cfg.max_num_batched_tokens == 4096


def test_no_chunked_prefill_builds_a_valid_engine(tiny_llama_dir):
    loaded = load_model(resolve_model(tiny_llama_dir), torch.float32, "cpu", progress=False)
    cfg = _config("--model", tiny_llama_dir, "--no-chunked-prefill", "--max-model-len", "300")
    scheduler = build_engine(cfg, loaded).scheduler.config
    assert not scheduler.enable_chunked_prefill
    assert scheduler.max_num_batched_tokens == scheduler.max_model_len == 300
