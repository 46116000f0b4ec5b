"""gpu_memory_utilization: the budget arithmetic (pure), the dummy step's layout, the dummy
step run through the real model on the CPU, the CUDA measurement's sequence with torch.cuda
faked, and that the CPU keeps sizing by bytes / fraction of free memory, paying nothing."""
from __future__ import annotations

import logging
import math

import pytest
import torch

from pdserve.engine import LLM
from pdserve.engine.attention.selector import get_attention_backend
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.engine_setup import log_kv_cache, memory_profile
from pdserve.engine.worker import kv_cache
from pdserve.engine.worker import memory_profile as mp
from pdserve.engine.worker.kv_cache import allocate_kv_caches, bytes_per_block, num_kv_blocks
from pdserve.engine.worker.memory_profile import MemoryProfile, kv_budget_bytes, profile_batch, run_profile_step

GiB = 1 << 30
CUDA = torch.device("cuda")  # a device object only: nothing here touches a GPU


# ---- the arithmetic -----------------------------------------------------------------------
def test_budget_is_utilization_of_total_less_in_use_and_activation_peak():
    assert kv_budget_bytes(80 * GiB, 20 * GiB, 5 * GiB, 0.9) == 47 * GiB
    assert kv_budget_bytes(80 * GiB, 20 * GiB, 5 * GiB, 1.0) == 55 * GiB
    assert MemoryProfile(80 * GiB, 20 * GiB, 5 * GiB).kv_budget(0.5) == 15 * GiB


def test_no_room_left_names_the_field_and_states_the_numbers():
    with pytest.raises(ValueError) as e:
        kv_budget_bytes(80 * GiB, 20 * GiB, 5 * GiB, 0.3)  # 24 GiB allowed, 25 GiB taken
    message = str(e.value)
    assert message.startswith("gpu_memory_utilization: 0.3 of the device's 80.00 GiB is 24.00 GiB")
    assert "20.00 GiB are in use after loading the weights" in message and "peak at 5.00 GiB" in message


def test_exactly_no_room_is_no_room():
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_budget_bytes(100, 60, 40, 1.0)


@pytest.mark.parametrize("bad", [0, 0.0, -0.5, 1.01, 2, math.nan, True, "0.9"])
def test_utilization_outside_zero_to_one_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match=r"^gpu_memory_utilization: must be in \(0, 1\]"):
        CacheConfig(gpu_memory_utilization=bad)


def test_utilization_of_one_and_the_default():
    assert CacheConfig(gpu_memory_utilization=1).gpu_memory_utilization == 1
    assert CacheConfig().gpu_memory_utilization == 0.9


# ---- num_kv_blocks: which setting sizes the cache -------------------------------------------
def test_a_cuda_profile_sizes_the_cache_by_utilization(tiny):
    per_block = bytes_per_block(tiny.arch, 16, torch.float32)
    profile = MemoryProfile(total_bytes=1000 * per_block, in_use_bytes=300 * per_block,
                            activation_peak_bytes=100 * per_block + 1)
    cache = CacheConfig(gpu_memory_utilization=0.8)  # 800 - 300 - 100 blocks, less one byte
    assert num_kv_blocks(cache, tiny.arch, torch.float32, CUDA, 1, profile) == 399


def test_exact_bytes_win_over_the_profile(tiny):
    per_block = bytes_per_block(tiny.arch, 16, torch.float32)
    profile = MemoryProfile(1000 * per_block, 0, 0)
    cache = CacheConfig(kv_cache_memory_bytes=7 * per_block)
    assert num_kv_blocks(cache, tiny.arch, torch.float32, CUDA, 1, profile) == 7


def test_a_budget_under_one_block_names_gpu_memory_utilization(tiny):
    per_block = bytes_per_block(tiny.arch, 16, torch.float32)
    profile = MemoryProfile(10 * per_block, 9 * per_block, per_block // 2)
    with pytest.raises(ValueError, match="^gpu_memory_utilization: a budget of .* holds no KV block"):
        num_kv_blocks(CacheConfig(gpu_memory_utilization=1.0), tiny.arch, torch.float32, CUDA, 1, profile)


def test_the_cpu_ignores_utilization_and_keeps_the_fraction_of_free_memory(tiny, monkeypatch):
    per_block = bytes_per_block(tiny.arch, 16, torch.float32)
    monkeypatch.setattr(kv_cache, "available_memory", lambda device: 1000 * per_block)
    cpu = torch.device("cpu")
    for utilization in (0.05, 0.9, 1.0):
        cache = CacheConfig(kv_cache_memory_fraction=0.1, gpu_memory_utilization=utilization)
        assert num_kv_blocks(cache, tiny.arch, torch.float32, cpu) == 100
        assert num_kv_blocks(cache, tiny.arch, torch.float32, cpu, num_ranks=2) == 50  # ranks share the host


def test_the_cpu_never_runs_the_profile():
    # no executor at all: it is not looked at, nothing is allocated or run
    assert memory_profile(EngineConfig(device="cpu"), None, None, torch.float32, torch.device("cpu")) is None
    exact = EngineConfig(device="cuda", attention_backend="triton", cache=CacheConfig(kv_cache_memory_bytes=1 << 20))
    assert memory_profile(exact, None, None, torch.float32, CUDA) is None


# ---- the dummy step -----------------------------------------------------------------------
def test_the_dummy_step_layout():
    # 40 tokens, prefills of at most 16, blocks of 8:  seqs [8][16][16], blocks [0][1 2][3 4]
    inputs, num_blocks = profile_batch(40, 16, 5, 8, torch.device("cpu"))
    m = inputs.meta
    assert num_blocks == 5 and m.num_decodes == 0
    assert m.seq_lens.tolist() == [8, 16, 16] and m.query_start_loc.tolist() == [0, 8, 24, 40]
    assert m.block_tables.tolist() == [[0, 0], [1, 2], [3, 4]]
    assert m.slot_mapping.tolist() == list(range(40))  # consecutive blocks: slot = token index
    assert inputs.positions.tolist() == list(range(8)) + list(range(16)) * 2
    assert (m.max_query_len, m.max_seq_len) == (16, 16)
    assert inputs.logits_indices.tolist() == [35, 36, 37, 38, 39]


def test_a_one_token_rest_is_the_step_s_decode():
    inputs, num_blocks = profile_batch(33, 16, 64, 16, torch.device("cpu"))
    assert inputs.meta.seq_lens.tolist() == [1, 16, 16] and inputs.meta.num_decodes == 1
    assert num_blocks == 3 and inputs.logits_indices.tolist() == list(range(33))  # rows capped by the tokens


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_the_dummy_step_runs_through_the_real_model(tiny, backend):
    """What the CUDA profile runs, on the CPU: the forward over its tiny cache, then the sampler."""
    inputs, num_blocks = profile_batch(96, 40, 8, 16, torch.device("cpu"))
    caches = allocate_kv_caches(num_blocks, tiny.arch, 16, torch.float32, torch.device("cpu"))
    run_profile_step(tiny.model, get_attention_backend(backend), inputs, caches)
    assert all(c.abs().sum() > 0 for c in caches)  # every layer wrote its K/V into the profile cache


def test_the_cuda_measurement_sequence(tiny, monkeypatch):
    """torch.cuda faked: the peak is counted from after the profile cache is allocated, and
    in use is read after the step's memory is given back."""
    calls = []
    fake = {
        "synchronize": lambda device=None: calls.append("sync"),
        "reset_peak_memory_stats": lambda device=None: calls.append("reset"),
        "memory_allocated": lambda device=None: calls.append("allocated") or 100,
        "max_memory_allocated": lambda device=None: calls.append("max") or 350,
        "empty_cache": lambda: calls.append("empty"),
        "mem_get_info": lambda device=None: calls.append("info") or (600, 1000),
    }
    for name, fn in fake.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    monkeypatch.setattr(mp, "run_profile_step", lambda *args: calls.append("step"))
    profile = mp.profile_memory(tiny.model, get_attention_backend("torch"), tiny.arch, 16, torch.float32,
                                torch.device("cpu"), 64, 32, 4)
    assert profile == MemoryProfile(total_bytes=1000, in_use_bytes=400, activation_peak_bytes=250)
    assert calls == ["sync", "reset", "allocated", "step", "sync", "max", "empty", "info"]


# ---- the start-up line --------------------------------------------------------------------
def test_the_kv_cache_line_as_vllm_logs_it(caplog):
    with caplog.at_level(logging.INFO, logger="pdserve.engine.engine_setup"):
        log_kv_cache(1234, 16, 2 << 20, 2048, 1)
    assert caplog.messages == ["KV cache: 1234 blocks of 16 tokens = 19744 tokens (2.41 GiB); "
                               "maximum concurrency for 2048 tokens per request: 9.64x"]


def test_the_engine_logs_its_kv_cache_at_start(tiny, tiny_llama_dir, caplog):
    per_block = bytes_per_block(tiny.arch, 16, torch.float32)
    with caplog.at_level(logging.INFO, logger="pdserve.engine"):
        llm = LLM(tiny_llama_dir, loaded_model=tiny, progress=False, kv_cache_memory_bytes=4096 * per_block,
                  max_model_len=2048)
    assert llm.engine.kv_manager.pool.num_blocks == 4096
    gib = 4096 * per_block / GiB
    line = (f"KV cache: 4096 blocks of 16 tokens = 65536 tokens ({gib:.2f} GiB); "
            "maximum concurrency for 2048 tokens per request: 32.00x")
    assert line in caplog.messages
