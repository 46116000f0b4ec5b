"""Tiny GGUF files written here as llama.cpp's converter writes a Llama: the tiny random
Llama's weights (tests/models.py) quantized by gguf-py in a chosen block type, Q and K rows
permuted llama.cpp's way, SmolLM2's tokenizer metadata."""
from __future__ import annotations

import os

import numpy as np

from tests.models import smollm2_gguf_path

# SmolLM2's tokenizer keys, copied with the writer's typed setters
_TOKENIZER_SETTERS = {
    "tokenizer.ggml.model": "add_tokenizer_model", "tokenizer.ggml.pre": "add_tokenizer_pre",
    "tokenizer.ggml.tokens": "add_token_list", "tokenizer.ggml.merges": "add_token_merges",
    "tokenizer.ggml.token_type": "add_token_types", "tokenizer.ggml.bos_token_id": "add_bos_token_id",
    "tokenizer.ggml.eos_token_id": "add_eos_token_id", "tokenizer.ggml.unknown_token_id": "add_unk_token_id",
    "tokenizer.ggml.padding_token_id": "add_pad_token_id", "tokenizer.ggml.add_bos_token": "add_add_bos_token",
    "tokenizer.ggml.add_space_prefix": "add_add_space_prefix", "tokenizer.chat_template": "add_chat_template",
}
_LAYER_TENSORS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                  "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                  "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def _permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf: each head's rotary halves interleaved."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(hf_dir: str, path: str, ggml_type: str, embedding_type: str = "Q8_0",
                    mixed_layer: int | None = None) -> str:
    """The Llama of `hf_dir` as a GGUF file: projections in `ggml_type` (Q4_0, Q4_1, Q8_0),
    the embedding in `embedding_type`, norms F32. `mixed_layer`: that layer's k_proj in Q8_0
    instead (a fused q/k/v of unlike parts)."""
    import gguf
    from safetensors.numpy import load_file
    from transformers import AutoConfig

    types = gguf.GGMLQuantizationType
    cfg = AutoConfig.from_pretrained(hf_dir)
    tensors = load_file(os.path.join(hf_dir, "model.safetensors"))
    w = gguf.GGUFWriter(path, "llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_theta if hasattr(cfg, "rope_theta") else cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    from pdserve.engine.model.gguf_file import GGUFFile
    source = GGUFFile(smollm2_gguf_path()).metadata
    for key, setter in _TOKENIZER_SETTERS.items():
        getattr(w, setter)(source[key])

    def add(name: str, value: np.ndarray, kind: str) -> None:
        value = value.astype(np.float32)
        if kind == "F32":
            w.add_tensor(name, value)
        else:
            blocks = gguf.quants.quantize(value, types[kind])
            w.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=types[kind])

    add("token_embd.weight", tensors["model.embed_tokens.weight"], embedding_type)
    add("output_norm.weight", tensors["model.norm.weight"], "F32")
    if not cfg.tie_word_embeddings:
        add("output.weight", tensors["lm_head.weight"], embedding_type)
    for layer in range(cfg.num_hidden_layers):
        for hf_name, ours in _LAYER_TENSORS.items():
            value = tensors[f"model.layers.{layer}.{hf_name}.weight"]
            if ours == "attn_q":
                value = _permute(value, cfg.num_attention_heads)
            elif ours == "attn_k":
                value = _permute(value, cfg.num_key_value_heads)
            kind = "F32" if ours.endswith("norm") else ggml_type
            if layer == mixed_layer and ours == "attn_k":
                kind = "Q8_0"
            add(f"blk.{layer}.{ours}.weight", value, kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
