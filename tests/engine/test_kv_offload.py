"""The host tier in the engine (kv_offloading_bytes): a device KV cache so small that a
prompt's blocks are evicted before it comes back, and a host tier that keeps them. Every
output is token-exact with transformers (and the engine without offloading), host hits
happen where the device alone misses, and this holds through chunked prefill, preemption,
a sliding window, speculative decoding, cache salts, prefill-only export, decode-only
import, and tensor/pipeline-parallel ranks."""
from __future__ import annotations

import random

import pytest
import torch

from bench.tiny_checkpoints import build_tiny_checkpoint
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.executor.config import ParallelConfig
from pdserve.engine.executor.launch import rank_kv_arch
from pdserve.engine.model.loader import load_model
from pdserve.engine.model.source import resolve_model
from pdserve.engine.request import RequestMode
from pdserve.engine.worker.kv_cache import bytes_per_block
from tests.engine.correctness import run_to_completion
from tests.engine.hf_reference import hf_greedy, load_hf_model
from tests.models import smollm2_tokenizer

MAX_TOKENS = 12
NUM_DEVICE_BLOCKS = 24
NUM_HOST_BLOCKS = 64


def _scenario(vocab_size: int, seed: int = 0) -> list[list[list[int]]]:
    """Three rounds, each one generate() call: two prompts; four others that together take
    the whole device cache (the first two's blocks are evicted); the first two's prefixes
    again with new endings."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab_size) for _ in range(n)]
    first = [tokens(80), tokens(70)]
    others = [tokens(75) for _ in range(4)]
    again = [first[0][:64] + tokens(9), first[1][:48] + tokens(20)]
    return [first, others, again]


def _block_bytes(loaded) -> int:
    return bytes_per_block(loaded.arch, 16, torch.float32)


def _kwargs(loaded, offload: bool, **extra) -> dict:
    block = _block_bytes(loaded)
    return dict(kv_cache_memory_bytes=NUM_DEVICE_BLOCKS * block,
                kv_offloading_bytes=NUM_HOST_BLOCKS * block if offload else None, progress=False, **extra)


def _run_rounds(llm: LLM, rounds, params: SamplingParams | None = None, salts=None):
    """Token ids of every prompt, round after round; and each last-round output's cached tokens."""
    params = params or SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    tokens, cached = [], []
    for i, prompts in enumerate(rounds):
        salt = (salts or [""] * len(rounds))[i]
        outs = llm.generate([{"prompt_token_ids": p, "cache_salt": salt} for p in prompts], params)
        tokens += [o.token_ids for o in outs]
        cached = [o.num_cached_tokens for o in outs]
    return tokens, cached


@pytest.fixture(scope="module")
def rounds(tiny):
    return _scenario(tiny.arch.vocab_size)


@pytest.fixture(scope="module")
def expected(tiny_llama_dir, tiny, rounds):
    return hf_greedy(load_hf_model(tiny_llama_dir), [p for r in rounds for p in r], MAX_TOKENS, tiny.eos_token_ids)


@pytest.fixture(scope="module")
def device_only(tiny_llama_dir, tiny, rounds):
    """The same rounds without a host tier: token-exact too, but the last round finds
    (almost) nothing."""
    llm = LLM(tiny_llama_dir, loaded_model=tiny, **_kwargs(tiny, offload=False))
    return _run_rounds(llm, rounds)


MODES = {
    "default": {},
    "chunked": dict(long_prefill_token_threshold=7, max_num_batched_tokens=40),
    "unchunked": dict(enable_chunked_prefill=False, max_num_batched_tokens=None, max_model_len=256),
    # 16 device blocks: the four prompts of round 2 do not fit at once, requests are preempted
    # and resume by recomputing, from the host tier where their evicted blocks went
    "preempting": dict(device_blocks=16),
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_evicted_prefixes_come_back_from_host_token_exact(tiny_llama_dir, tiny, rounds, expected, device_only, mode):
    extra = dict(MODES[mode])
    kwargs = _kwargs(tiny, offload=True)
    kwargs["kv_cache_memory_bytes"] = extra.pop("device_blocks", NUM_DEVICE_BLOCKS) * _block_bytes(tiny)
    llm = LLM(tiny_llama_dir, loaded_model=tiny, **kwargs, **extra)
    tokens, cached = _run_rounds(llm, rounds)
    assert tokens == expected
    stats = llm.engine.stats()
    assert stats.host.num_hit_tokens > 0 and stats.host.num_onloaded_blocks > 0
    assert stats.host.num_offloaded_blocks >= stats.host.num_used_blocks > 0
    assert stats.host.num_total_blocks == NUM_HOST_BLOCKS
    if mode == "preempting":
        assert stats.num_preemptions > 0
    else:  # the device alone lost the first round's blocks; the host kept them
        _, cached_device_only = device_only
        assert sum(cached) > sum(cached_device_only)
        assert cached == [64, 48]
    kv = llm.engine.kv_manager
    assert kv.num_free_blocks == kv.pool.num_blocks


def test_the_device_only_engine_is_token_exact_and_misses(device_only, expected):
    tokens, cached = device_only
    assert tokens == expected
    assert cached[0] < 64 and cached[1] < 48


def test_host_hits_are_counted_for_the_prefill_worker(tiny_llama_dir, tiny, rounds):
    """What a prefill worker asks the kvstore for starts after the engine's local blocks:
    those include the host tier's."""
    llm = LLM(tiny_llama_dir, loaded_model=tiny, **_kwargs(tiny, offload=True))
    _run_rounds(llm, rounds[:2])
    engine = llm.engine
    hashes = engine.info.prompt_block_hashes(rounds[0][0], "")[:4]
    assert engine.kv_manager.find_longest_cache_hit(hashes) == []  # not on the device any more
    assert engine.num_local_prefix_blocks(hashes) == 4


def test_a_cache_salt_is_kept_on_host_too(tiny_llama_dir, tiny, rounds, expected):
    llm = LLM(tiny_llama_dir, loaded_model=tiny, **_kwargs(tiny, offload=True))
    tokens, cached = _run_rounds(llm, rounds, salts=["tenant-a", "tenant-a", "tenant-b"])
    assert tokens == expected and cached == [0, 0]
    tokens, cached = _run_rounds(llm, [rounds[2]], salts=["tenant-a"])
    assert tokens == expected[-2:] and cached == [64, 48]


def test_speculative_decoding_with_offload_equals_without(tiny_llama_dir, tiny, rounds, expected):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = LLM(tiny_llama_dir, loaded_model=tiny, speculative_config=spec, **_kwargs(tiny, offload=True))
    tokens, cached = _run_rounds(llm, rounds)
    assert tokens == expected and cached == [64, 48]
    assert llm.engine.stats().spec.num_proposed_tokens > 0


def test_prefix_caching_off_refuses_offloading(tiny_llama_dir, tiny):
    with pytest.raises(ValueError, match="kv_offloading_bytes.*enable_prefix_caching"):
        LLM(tiny_llama_dir, loaded_model=tiny, enable_prefix_caching=False, **_kwargs(tiny, offload=True))


def test_an_offloading_budget_below_one_block_is_refused(tiny_llama_dir, tiny):
    with pytest.raises(ValueError, match="kv_offloading_bytes: 100 bytes hold no KV block"):
        LLM(tiny_llama_dir, loaded_model=tiny, kv_offloading_bytes=100, progress=False)


# ---- the hand-off: prefill-only export and decode-only import --------------------------
def _one(engine, req_id: str, prompt, **kwargs):
    return run_to_completion(engine, [(req_id, prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                                       kwargs)])[req_id]


def test_a_prefill_export_from_host_hits_hands_off_token_exact(tiny_llama_dir, tiny, rounds, expected):
    prompt, want = rounds[2][0], expected[-2]
    reference = LLM(tiny_llama_dir, loaded_model=tiny, progress=False).engine
    reference_export = _one(reference, "p", prompt, mode=RequestMode.PREFILL_ONLY).kv_export
    llm = LLM(tiny_llama_dir, loaded_model=tiny, **_kwargs(tiny, offload=True))
    _run_rounds(llm, rounds[:2])
    out = _one(llm.engine, "p", prompt, mode=RequestMode.PREFILL_ONLY)
    assert out.num_cached_tokens == 64 and out.token_ids == want[:1]
    assert out.kv_export.block_hashes == reference_export.block_hashes
    num_full, num_tail = divmod(out.kv_export.num_tokens, 16)  # the tail block's slots past them are stale
    for got, want_blocks in [(out.kv_export.blocks[:num_full], reference_export.blocks[:num_full]),
                             (out.kv_export.blocks[num_full, :, :, :num_tail],
                              reference_export.blocks[num_full, :, :, :num_tail])]:
        torch.testing.assert_close(got, want_blocks, rtol=1e-4, atol=1e-5)
    # a decode engine with offloading imports it and goes on as transformers does
    decode = LLM(tiny_llama_dir, loaded_model=tiny, **_kwargs(tiny, offload=True)).engine
    final = _one(decode, "d", prompt, mode=RequestMode.DECODE_ONLY, output_token_ids=want[:1],
                 kv_import=out.kv_export)
    assert final.token_ids == want


def test_a_decode_import_over_host_hits_is_token_exact(tiny_llama_dir, tiny, rounds, expected):
    """The local blocks (here from the host tier) cover the import's first blocks; the rest
    of the import is written after them."""
    prompt, want = rounds[2][1], expected[-1]
    reference = LLM(tiny_llama_dir, loaded_model=tiny, progress=False).engine
    export = _one(reference, "p", prompt, mode=RequestMode.PREFILL_ONLY).kv_export
    llm = LLM(tiny_llama_dir, loaded_model=tiny, **_kwargs(tiny, offload=True))
    _run_rounds(llm, rounds[:2])
    before = llm.engine.stats().host.num_hit_tokens
    final = _one(llm.engine, "d", prompt, mode=RequestMode.DECODE_ONLY, output_token_ids=want[:1], kv_import=export)
    assert final.token_ids == want
    assert llm.engine.stats().host.num_hit_tokens - before == 48


# ---- a sliding-window model: blocks freed behind the window are offloaded like any other --
@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    path = build_tiny_checkpoint("mistral", tmp_path_factory.mktemp("mistral"), smollm2_tokenizer())
    loaded = load_model(resolve_model(path), torch.float32, "cpu", progress=False)
    assert loaded.arch.max_window is not None
    return path, loaded


def test_a_sliding_window_model_offloads_token_exact(mistral):
    path, loaded = mistral
    rounds = _scenario(loaded.arch.vocab_size, seed=5)
    expected = hf_greedy(load_hf_model(path), [p for r in rounds for p in r], MAX_TOKENS, loaded.eos_token_ids)
    llm = LLM(path, loaded_model=loaded, **_kwargs(loaded, offload=True))
    tokens, cached = _run_rounds(llm, rounds)
    assert tokens == expected
    assert llm.engine.kv_manager.num_windowed_out_blocks > 0
    assert llm.engine.stats().host.num_hit_tokens > 0 and sum(cached) > 0


# ---- ranks: each keeps its part of every block in its own host buffer --------------------
@pytest.mark.parametrize("t,p", [(2, 1), (1, 2)])
def test_parallel_ranks_offload_token_exact(tiny_llama_dir, tiny, rounds, expected, t, p):
    parallel = ParallelConfig(tensor_parallel_size=t, pipeline_parallel_size=p)
    per_rank = bytes_per_block(rank_kv_arch(parallel, tiny.arch), 16, torch.float32)  # its heads and layers
    llm = LLM(tiny_llama_dir, tensor_parallel_size=t, pipeline_parallel_size=p, collective_timeout_s=60,
              kv_cache_memory_bytes=NUM_DEVICE_BLOCKS * per_rank,  # per rank
              kv_offloading_bytes=NUM_HOST_BLOCKS * per_rank * t * p, progress=False)  # all ranks together
    try:
        tokens, cached = _run_rounds(llm, rounds)
        assert tokens == expected and cached == [64, 48]
        assert llm.engine.stats().host.num_total_blocks == NUM_HOST_BLOCKS
    finally:
        llm.shutdown()
