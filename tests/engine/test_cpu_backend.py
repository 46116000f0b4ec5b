"""The cpu attention backend (C++ decode kernel) against the torch backend: one mixed step
bit for bit in the cache and closely in the output, and the same greedy tokens end to end."""
from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM, EngineConfig, SamplingParams
from pdserve.engine.attention.backend import AttentionMetadata
from pdserve.engine.attention.selector import get_attention_backend
from pdserve.engine.engine_core import EngineCore


def mixed_step() -> tuple:
    """Three decodes (contexts 1, 16 and 40) then prefill chunks of 5 (over a 20-token prefix) and 3."""
    torch.manual_seed(0)
    seq_lens, q_lens = [1, 16, 40, 25, 3], [1, 1, 1, 5, 3]
    tables = torch.randperm(16)[:15].view(5, 3).to(torch.int32)
    slots = [int(tables[i][p // 16]) * 16 + p % 16 for i, (n, q) in enumerate(zip(seq_lens, q_lens))
             for p in range(n - q, n)]
    loc = torch.tensor([0, 1, 2, 3, 8, 11], dtype=torch.int32)
    meta = AttentionMetadata(num_decodes=3, query_start_loc=loc, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                             block_tables=tables, slot_mapping=torch.tensor(slots), max_query_len=5,
                             max_seq_len=40)
    query, key, value = torch.randn(11, 6, 32), torch.randn(11, 2, 32), torch.randn(11, 2, 32)
    return query, key, value, torch.randn(2, 16, 16, 2, 32), meta


# (window, softcap): off; a window under a block (the 40-token decode and the chunk see part of
# their context, short sequences all of it); a soft-cap alone; both
VARIANTS = [(None, None), (7, None), (None, 5.0), (20, 30.0)]


@pytest.mark.parametrize("window,softcap", VARIANTS)
def test_mixed_step_matches_torch_backend(window, softcap):
    query, key, value, kv_cache, meta = mixed_step()
    ref_cache = kv_cache.clone()
    variant = dict(window=window, softcap=softcap)
    out = get_attention_backend("cpu").forward(query, key, value, kv_cache, meta, 0.2, **variant)
    ref = get_attention_backend("torch").forward(query, key, value, ref_cache, meta, 0.2, **variant)
    assert torch.equal(kv_cache, ref_cache)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def generate_greedy(model_dir: str, attention_backend: str) -> list[list[int]]:
    llm = LLM(model=model_dir, attention_backend=attention_backend, max_num_batched_tokens=16,
              long_prefill_token_threshold=7, kv_cache_memory_bytes=1 << 20, progress=False)
    prompts = ["The quick brown fox jumps over the lazy dog", "Hello",
               {"prompt_token_ids": list(range(1, 40))}]
    return [out.token_ids for out in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12))]


def test_engine_greedy_tokens_match_torch_backend(tiny_llama_dir):
    tokens = generate_greedy(tiny_llama_dir, "cpu")
    assert tokens == generate_greedy(tiny_llama_dir, "torch")
    assert all(len(t) == 12 for t in tokens)


def test_cpu_is_the_default_backend():
    assert EngineConfig().attention_backend == "cpu"


def test_cpu_backend_refuses_a_gpu_device(tiny_llama_dir):
    with pytest.raises(ValueError, match="attention_backend 'cpu' runs on the CPU only"):
        EngineCore(EngineConfig(model=tiny_llama_dir, device="cuda"), progress=False)


def test_cpu_engine_runs_norms_and_rope_on_the_cpp_ops(tiny_llama_dir):
    from pdserve.engine.model.decoder import RMSNorm
    from pdserve.engine.model.rope import RotaryEmbedding
    llm = LLM(model=tiny_llama_dir, kv_cache_memory_bytes=1 << 20, progress=False)
    fusable = [m for m in llm.engine.runner.model.modules() if isinstance(m, (RMSNorm, RotaryEmbedding))]
    assert fusable and all(m.fused for m in fusable)
