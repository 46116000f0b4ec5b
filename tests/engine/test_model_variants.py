"""Architecture variants token-exact with transformers: Qwen2 (q/k/v bias), Llama 3 RoPE
scaling with untied embeddings, and bfloat16 running end to end."""
from __future__ import annotations

import torch

from pdserve.engine import LLM, SamplingParams
from tests.engine.hf_reference import hf_greedy, load_hf_model
from tests.models import smollm2_tokenizer

PROMPTS = [[5, 17, 300, 4000], list(range(100, 190)), [42] * 40]


def _save(model, tokenizer, path) -> str:
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.08)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def _compare(path: str, max_tokens: int = 12) -> None:
    llm = LLM(path, progress=False, long_prefill_token_threshold=16)
    got = [o.token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                             SamplingParams(temperature=0, max_tokens=max_tokens))]
    assert got == hf_greedy(load_hf_model(path), PROMPTS, max_tokens, llm.engine.loaded.eos_token_ids)


def test_qwen2_with_qkv_bias(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    tok = smollm2_tokenizer()
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=True, eos_token_id=tok.eos_token_id)
    torch.manual_seed(1)
    _compare(_save(Qwen2ForCausalLM(cfg), tok, tmp_path / "qwen2"))


def test_llama3_rope_scaling_untied_embeddings(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM
    tok = smollm2_tokenizer()
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=1024,
                      tie_word_embeddings=False, rope_theta=500000.0, rope_scaling=scaling,
                      eos_token_id=tok.eos_token_id)
    torch.manual_seed(2)
    _compare(_save(LlamaForCausalLM(cfg), tok, tmp_path / "llama3"))


def test_bfloat16_runs_and_mostly_agrees(tiny_llama_dir):
    fp32 = LLM(tiny_llama_dir, progress=False).generate(
        [{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=8))
    llm = LLM(tiny_llama_dir, dtype="bfloat16", progress=False)
    assert llm.engine.runner.kv_caches[0].dtype == torch.bfloat16
    bf16 = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=8))
    # bf16 rounding may flip a late near-tie; the first token of each prompt must agree
    assert [o.token_ids[0] for o in bf16] == [o.token_ids[0] for o in fp32]
