"""Reading a decoder's shape from config.json or from GGUF metadata."""
from __future__ import annotations

from engine.config import ModelArchConfig
from engine.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"}
# GGUF architecture names and whether llama.cpp permuted their Q/K rows for its RoPE layout
GGUF_ARCHITECTURES = {"llama": ("LlamaForCausalLM", True), "qwen2": ("Qwen2ForCausalLM", False)}


def arch_from_hf_config(cfg: dict, source: str) -> ModelArchConfig:
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(source, f"unsupported architectures {archs}; supported: "
                                     f"{sorted(SUPPORTED_ARCHITECTURES)}")
    try:
        num_heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_theta = cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        if scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = None
        return ModelArchConfig(
            architecture=arch, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads, num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=float(rope_theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", arch == "Qwen2ForCausalLM"),
            rope_scaling=scaling)
    except KeyError as e:
        raise ModelLoadError(source, f"config.json lacks {e.args[0]!r}") from None


def arch_from_gguf_metadata(meta: dict, tensor_names: set[str], source: str) -> ModelArchConfig:
    gguf_arch = meta.get("general.architecture")
    if gguf_arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(source, f"unsupported GGUF architecture {gguf_arch!r}; "
                                     f"supported: {sorted(GGUF_ARCHITECTURES)}")

    def key(name: str, default=None):
        value = meta.get(f"{gguf_arch}.{name}", default)
        if value is None:
            raise ModelLoadError(source, f"GGUF metadata lacks {gguf_arch}.{name}")
        return value

    hidden, num_heads = key("embedding_length"), key("attention.head_count")
    vocab = meta.get(f"{gguf_arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
    return ModelArchConfig(
        architecture=GGUF_ARCHITECTURES[gguf_arch][0], vocab_size=int(vocab), hidden_size=int(hidden),
        intermediate_size=int(key("feed_forward_length")), num_layers=int(key("block_count")),
        num_heads=int(num_heads), num_kv_heads=int(key("attention.head_count_kv", num_heads)),
        head_dim=int(key("rope.dimension_count", hidden // num_heads)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        max_position_embeddings=int(key("context_length")),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        rope_scaling={"rope_type": "gguf_freq_factors"} if "rope_freqs.weight" in tensor_names else None)
