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
                    mixed_layer: int | None = None, types: dict[str, str] | None = None) -> str:
    """The Llama of `hf_dir` as a GGUF file: projections in `ggml_type` (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, and
    Q4_K or Q6_K where the rows hold 256-column blocks), the embedding in `embedding_type`,
    norms F32. `mixed_layer`: that layer's k_proj in Q8_0 instead (a fused q/k/v of unlike
    parts). `types`: the type of the tensors it names (GGUF names), as llama.cpp's Q4_K_M
    mixes Q4_K and Q6_K."""
    import gguf
    from safetensors.numpy import load_file
    from transformers import AutoConfig

    ggml_types = gguf.GGMLQuantizationType
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
        kind = (types or {}).get(name, kind)
        if kind == "F32":
            w.add_tensor(name, value)
        elif kind.endswith("_K"):
            blocks = quantize_k(value, kind)
            w.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=ggml_types[kind])
        else:
            blocks = gguf.quants.quantize(value, ggml_types[kind])
            w.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=ggml_types[kind])

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


def quantize_k(value: np.ndarray, kind: str) -> np.ndarray:
    """`value` [rows, cols] (cols a multiple of 256) in Q4_K or Q6_K blocks, uint8 [rows, bytes]:
    a plain round-to-nearest quantizer (gguf-py has none for the K-quants; llama.cpp's searches
    for better scales), packed as ggml lays the blocks out. Only the layout must be right:
    the tests compare with gguf-py's dequantizer over these bytes."""
    rows, cols = value.shape
    x = value.astype(np.float32).reshape(-1, 256)
    quantize = _quantize_q4_k if kind == "Q4_K" else _quantize_q6_k
    return quantize(x).reshape(rows, -1)


def _quantize_q4_k(x: np.ndarray) -> np.ndarray:
    groups = x.reshape(len(x), 8, 32)
    low = np.minimum(groups.min(axis=-1), 0)
    scale, offset = (groups.max(axis=-1) - low) / 15, -low   # per 32 columns: x ~ scale q - offset
    d = np.maximum(scale.max(axis=-1, keepdims=True) / 63, 1e-8).astype(np.float16)
    dmin = np.maximum(offset.max(axis=-1, keepdims=True) / 63, 1e-8).astype(np.float16)
    sc = np.clip(np.rint(scale / _nonzero(d.astype(np.float32))), 1, 63).astype(np.uint8)
    m = np.clip(np.rint(offset / _nonzero(dmin.astype(np.float32))), 0, 63).astype(np.uint8)
    step = _nonzero((d.astype(np.float32) * sc)[..., None])
    q = np.clip(np.rint((groups + (dmin.astype(np.float32) * m)[..., None]) / step), 0, 15).astype(np.uint8)
    packed = np.zeros((len(x), 12), dtype=np.uint8)  # ggml's get_scale_min_k4, inverted
    packed[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    q = q.reshape(len(x), 4, 2, 32)
    quants = q[:, :, 0] | (q[:, :, 1] << 4)  # even groups in the low nibbles, odd ones in the high
    return np.concatenate([d.view(np.uint8), dmin.view(np.uint8), packed, quants.reshape(len(x), 128)], axis=1)


def _quantize_q6_k(x: np.ndarray) -> np.ndarray:
    groups = x.reshape(len(x), 16, 16)
    scale = np.abs(groups).max(axis=-1) / 31
    d = np.maximum(scale.max(axis=-1, keepdims=True) / 127, 1e-8).astype(np.float16)
    sc = np.clip(np.rint(scale / _nonzero(d.astype(np.float32))), 1, 127).astype(np.int8)
    step = _nonzero((d.astype(np.float32) * sc)[..., None])
    q = (np.clip(np.rint(groups / step), -32, 31) + 32).astype(np.uint8).reshape(len(x), 2, 4, 32)
    low = (q & 0x0F)
    low = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=-1)
    high = (q >> 4)
    high = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    return np.concatenate([low.reshape(len(x), 128), high.reshape(len(x), 64), sc.view(np.uint8), d.view(np.uint8)],
                          axis=1)


def _nonzero(step: np.ndarray) -> np.ndarray:
    """A block of zeros has zero scales (fp16 underflow): divide by 1 instead, any quant reads 0."""
    return np.where(step == 0, np.float32(1), step)
