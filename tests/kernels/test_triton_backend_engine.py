"""The Triton attention backend (in the Triton interpreter) against the torch backend:
single steps directly, then the whole engine's greedy tokens."""
from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.attention.backend import AttentionMetadata
from pdserve.engine.attention.selector import get_attention_backend


def make_step(seq_lens: list[int], query_lens: list[int], block_size: int = 16) -> AttentionMetadata:
    """One step's metadata, decodes (query length 1) first; 3 shuffled blocks per sequence."""
    block_ids = torch.randperm(16).tolist()
    tables, slots = [], []
    for i, (seq_len, query_len) in enumerate(zip(seq_lens, query_lens)):
        blocks = block_ids[3 * i:3 * i + 3]
        tables.append(blocks)
        positions = range(seq_len - query_len, seq_len)
        slots += [blocks[p // block_size] * block_size + p % block_size for p in positions]
    return AttentionMetadata(
        num_decodes=query_lens.count(1),
        query_start_loc=torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        slot_mapping=torch.tensor(slots), max_query_len=max(query_lens), max_seq_len=max(seq_lens))


@pytest.mark.parametrize("seq_lens,query_lens", [
    ([17, 32, 40, 9], [1, 1, 8, 9]),  # decodes, a chunk after a cached prefix, a fresh prompt
    ([40, 9], [8, 9]),                # prefills only
    ([17, 48, 3], [1, 1, 1]),         # decodes only
])
@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (None, 5.0), (20, 30.0)])
def test_backend_matches_torch_backend(seq_lens, query_lens, window, softcap):
    torch.manual_seed(0)
    meta = make_step(seq_lens, query_lens)
    num_tokens, num_heads, num_kv_heads, head_dim = sum(query_lens), 6, 2, 64
    query = torch.randn(num_tokens, num_heads, head_dim)
    key, value = torch.randn(2, num_tokens, num_kv_heads, head_dim)
    kv_cache = torch.randn(2, 16, 16, num_kv_heads, head_dim)
    ref_cache = kv_cache.clone()
    variant = dict(window=window, softcap=softcap)
    out = get_attention_backend("triton").forward(query, key, value, kv_cache, meta, 0.125, **variant)
    ref = get_attention_backend("torch").forward(query, key, value, ref_cache, meta, 0.125, **variant)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    assert torch.equal(kv_cache, ref_cache)


def generate_greedy(model_dir: str, attention_backend: str) -> list[list[int]]:
    # Chunks of at most 7 tokens and a 16-token step budget: prompts are prefilled in several
    # chunks over a cached prefix, side by side with other requests' decodes.
    llm = LLM(model=model_dir, attention_backend=attention_backend, max_num_batched_tokens=16,
              long_prefill_token_threshold=7, kv_cache_memory_bytes=1 << 20, progress=False)
    prompts = ["The quick brown fox jumps over the lazy dog", "Hello",
               {"prompt_token_ids": list(range(1, 24))}]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8))
    return [out.token_ids for out in outputs]


def test_engine_greedy_tokens_match_torch_backend(tiny_llama_dir):
    triton_tokens = generate_greedy(tiny_llama_dir, "triton")
    assert triton_tokens == generate_greedy(tiny_llama_dir, "torch")
    assert all(len(tokens) == 8 for tokens in triton_tokens)
