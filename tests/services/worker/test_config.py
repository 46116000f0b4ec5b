"""The worker command line: flags into WorkerConfig, WorkerConfig into the engine."""
from __future__ import annotations

import argparse
import dataclasses

import torch

import pytest

from pdserve.engine.config import EngineConfig, SchedulerConfig

from pdserve.engine.model.loader import load_model
from pdserve.engine.model.source import resolve_model
from pdserve.services.worker.config import add_worker_arguments, worker_config_from_args
from pdserve.services.worker.runtime import build_engine
from pdserve.services.common.defaults import KVSTORE_ADDRESS


def _config(*argv: str):
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser, default_port=0)
    return worker_config_from_args(parser.parse_args(list(argv)))


def test_chunked_prefill_is_on_by_default_with_a_fixed_budget():
    cfg = _config()
    scheduler = cfg.engine.scheduler
    assert scheduler.enable_chunked_prefill and scheduler.max_num_batched_tokens == 2048


def test_no_chunked_prefill_leaves_the_budget_to_max_model_len():
    cfg = _config("--no-chunked-prefill")
    scheduler = cfg.engine.scheduler
    assert not scheduler.enable_chunked_prefill and scheduler.max_num_batched_tokens is None


def test_an_explicit_budget_is_kept_without_chunked_prefill():
    cfg = _config("--no-chunked-prefill", "--max-num-batched-tokens", "4096")
    assert cfg.engine.scheduler.max_num_batched_tokens == 4096


def test_no_chunked_prefill_builds_a_valid_engine(tiny_llama_dir):
    loaded = load_model(resolve_model(tiny_llama_dir), torch.float32, "cpu", progress=False)
    cfg = _config("--model", tiny_llama_dir, "--no-chunked-prefill", "--max-model-len", "300")
    scheduler = build_engine(cfg, loaded).scheduler.config
    assert not scheduler.enable_chunked_prefill
    assert scheduler.max_num_batched_tokens == scheduler.max_model_len == 300


def test_flag_defaults_are_the_engine_config_defaults():
    """But for the order of prefill work: a worker serves srpt (short prompts overtake long
    ones), the engine keeps vLLM's fcfs (what LLM(...) users compare it with)."""
    cfg = _config()
    srpt = dataclasses.replace(SchedulerConfig(), scheduling_policy="srpt")
    assert cfg.engine == dataclasses.replace(EngineConfig(), scheduler=srpt)
    assert (cfg.port, cfg.kvstore_address) == (0, KVSTORE_ADDRESS)


def test_flags_reach_the_engine_config():
    cfg = _config("--model", "m", "--dtype", "bfloat16", "--max-num-seqs", "8", "--no-prefix-caching",
                  "--kv-cache-memory-bytes", "1024", "--long-prefill-token-threshold", "64")
    engine = cfg.engine
    assert (engine.model, engine.dtype, engine.scheduler.max_num_seqs) == ("m", "bfloat16", 8)
    assert (engine.cache.enable_prefix_caching, engine.cache.kv_cache_memory_bytes) == (False, 1024)
    assert engine.scheduler.long_prefill_token_threshold == 64


# ---- the order of prefill work and the step's time bound ----
def _role_config(role: str, *argv: str):
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser, default_port=0, role=role)
    return worker_config_from_args(parser.parse_args(list(argv))).engine.scheduler


def test_a_prefill_worker_bounds_its_steps_to_150_ms_a_decode_worker_does_not():
    assert (_role_config("prefill").max_step_ms, _role_config("prefill").scheduling_policy) == (150, "srpt")
    assert (_role_config("decode").max_step_ms, _role_config("decode").scheduling_policy) == (0, "srpt")


def test_the_order_and_the_time_bound_are_flags():
    scheduler = _role_config("prefill", "--max-step-ms", "100", "--scheduling-policy", "fcfs")
    assert (scheduler.max_step_ms, scheduler.scheduling_policy) == (100, "fcfs")
    assert _role_config("decode", "--max-step-ms", "50").max_step_ms == 50
    assert _role_config("prefill", "--max-step-ms", "0").max_step_ms == 0


def test_without_chunked_prefill_there_is_no_time_bound():
    assert _role_config("prefill", "--no-chunked-prefill").max_step_ms == 0
    assert _role_config("prefill", "--no-chunked-prefill", "--max-step-ms", "0").max_step_ms == 0
    with pytest.raises(ValueError, match="--max-step-ms: .*needs chunked prefill"):
        _role_config("prefill", "--no-chunked-prefill", "--max-step-ms", "250")


@pytest.mark.parametrize("flag,value,message", [
    ("--max-step-ms", "-1", "argument --max-step-ms: must be a number of milliseconds >= 0"),
    ("--max-step-ms", "nan", "argument --max-step-ms: must be a number of milliseconds >= 0"),
    ("--max-step-ms", "soon", "argument --max-step-ms: must be a number of milliseconds >= 0"),
    ("--scheduling-policy", "lifo", "argument --scheduling-policy: invalid choice: 'lifo'"),
])
def test_a_bad_value_is_refused_naming_the_flag(flag, value, message, capsys):
    with pytest.raises(SystemExit):
        _role_config("prefill", flag, value)
    assert message in capsys.readouterr().err
