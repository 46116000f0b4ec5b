"""Reading a decoder's shape from config.json or from GGUF metadata.

Every architecture is this engine's one decoder (engine/model/decoder.py) with features
switched on by the config: a windowed layer, q/k norms, Gemma's norms and soft-caps, a
mixture of experts. A config field this engine cannot honour is refused here, naming
the field, rather than loaded and answered wrongly.
"""
from __future__ import annotations

import math

from pdserve.engine.config import ModelArchConfig
from pdserve.engine.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
    "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM",
    "Qwen3MoeForCausalLM",
}
GEMMA = {"Gemma2ForCausalLM", "Gemma3ForCausalLM"}
QK_NORM = {"Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"}
MOE = {"MixtralForCausalLM", "Qwen3MoeForCausalLM"}
# GGUF architecture names and whether llama.cpp permuted their Q/K rows for its RoPE layout
GGUF_ARCHITECTURES = {"llama": ("LlamaForCausalLM", True), "qwen2": ("Qwen2ForCausalLM", False)}
ACTIVATIONS = {"silu", "gelu_pytorch_tanh"}

# transformers' defaults where a config.json leaves a field out
_DEFAULT_MAX_POSITIONS = {"Gemma2ForCausalLM": 8192, "Gemma3ForCausalLM": 131072,
                          "Phi3ForCausalLM": 4096, "MixtralForCausalLM": 131072}
_DEFAULT_THETA = {"Gemma3ForCausalLM": 1_000_000.0, "MixtralForCausalLM": 1_000_000.0}


def arch_from_hf_config(cfg: dict, source: str) -> ModelArchConfig:
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(source, f"architectures: unsupported {archs}; supported: "
                                     f"{sorted(SUPPORTED_ARCHITECTURES)}")
    try:
        return _read(cfg, arch, source)
    except KeyError as e:
        raise ModelLoadError(source, f"config.json lacks {e.args[0]!r}") from None


def _read(cfg: dict, arch: str, source: str) -> ModelArchConfig:
    num_heads, num_layers = cfg["num_attention_heads"], cfg["num_hidden_layers"]
    gemma = arch in GEMMA
    global_rope, local_theta = _rope(cfg, arch, source)
    theta = global_rope.pop("rope_theta")
    partial = float(global_rope.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    if not 0.0 < partial <= 1.0:
        raise ModelLoadError(source, f"partial_rotary_factor: must be in (0, 1], got {partial}")
    scaling = global_rope if global_rope.get("rope_type", global_rope.get("type", "default")) != "default" else None
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or ("gelu_pytorch_tanh" if gemma else "silu")
    if act not in ACTIVATIONS:
        raise ModelLoadError(source, f"hidden_act: {act!r} is not supported (supported: {sorted(ACTIVATIONS)})")
    if cfg.get("use_bidirectional_attention"):
        raise ModelLoadError(source, "use_bidirectional_attention: bidirectional (embedding) models are not served")
    moe = _moe(cfg, arch, num_layers, source) if arch in MOE else {}
    return ModelArchConfig(
        architecture=arch, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"], num_layers=num_layers,
        num_heads=num_heads, num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
        max_position_embeddings=cfg.get("max_position_embeddings", _DEFAULT_MAX_POSITIONS.get(arch, 2048)),
        tie_word_embeddings=cfg.get("tie_word_embeddings", gemma),
        attention_bias=cfg.get("attention_bias", arch == "Qwen2ForCausalLM"),
        rope_scaling=scaling, layer_windows=_layer_windows(cfg, arch, num_layers, source),
        qk_norm=arch in QK_NORM, gemma_norms=gemma, hidden_act=act,
        attn_logit_softcap=_softcap(cfg, "attn_logit_softcapping", 50.0 if arch == "Gemma2ForCausalLM" else None),
        final_logit_softcap=_softcap(cfg, "final_logit_softcapping", 30.0 if arch == "Gemma2ForCausalLM" else None),
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)) if gemma else None,
        local_rope_theta=local_theta, partial_rotary_factor=partial, **moe)


def _rope(cfg: dict, arch: str, source: str) -> tuple[dict, float | None]:
    """(the global layers' rope dict with rope_theta, Gemma 3's windowed layers' base or None).
    transformers 5 writes `rope_parameters` (Gemma 3: one per layer type); older configs
    `rope_theta` and `rope_scaling` (Gemma 3: `rope_local_base_freq` for local layers)."""
    params = cfg.get("rope_parameters") or {}
    theta_default = _DEFAULT_THETA.get(arch, 10000.0)
    if arch == "Gemma3ForCausalLM":
        if "full_attention" in params or "sliding_attention" in params:
            local = dict(params.get("sliding_attention") or {})
            if local.get("rope_type", "default") != "default":
                raise ModelLoadError(source, f"rope_parameters: sliding_attention rope type "
                                             f"{local['rope_type']!r} is not supported (only default)")
            glob = dict(params.get("full_attention") or {})
            glob.setdefault("rope_theta", cfg.get("rope_theta", theta_default))
            return glob, float(local.get("rope_theta", cfg.get("rope_local_base_freq", 10000.0)))
        local_theta = float(cfg.get("rope_local_base_freq", 10000.0))
    else:
        local_theta = None
    rope = dict(params or cfg.get("rope_scaling") or {})
    rope["rope_theta"] = cfg.get("rope_theta") or rope.get("rope_theta") or theta_default
    if "original_max_position_embeddings" in cfg:  # Phi-3 keeps it beside rope_scaling; it wins there
        rope["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
    kind = rope.get("rope_type", rope.get("type"))
    if arch == "Phi3ForCausalLM" and kind in ("su", "yarn"):  # Phi-3's old names of longrope
        rope["rope_type"] = "longrope"
        rope.pop("type", None)
    return rope, local_theta


def _layer_windows(cfg: dict, arch: str, num_layers: int, source: str) -> tuple[int | None, ...]:
    """Each layer's attention window as transformers builds its masks: `layer_types` when
    the config lists them, else each architecture's rule."""
    window = cfg.get("sliding_window")
    if "use_sliding_window" in cfg and not cfg["use_sliding_window"]:
        window = None  # Qwen2/Qwen3: the field is there, switched off
    if arch in GEMMA and window is None and "sliding_window" not in cfg:
        window = 4096
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ModelLoadError(source, f"sliding_window: must be a positive integer, got {window!r}")
    types = cfg.get("layer_types")
    if types is None:
        types = [_default_layer_type(cfg, arch, i, window) for i in range(num_layers)]
    if len(types) != num_layers:
        raise ModelLoadError(source, f"layer_types: {len(types)} entries for {num_layers} layers")
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ModelLoadError(source, f"layer_types: {unknown} not supported (full_attention, sliding_attention)")
    if window is None or "sliding_attention" not in types:
        return ()
    return tuple(window if t == "sliding_attention" else None for t in types)


def _default_layer_type(cfg: dict, arch: str, layer: int, window: int | None) -> str:
    if window is None:
        return "full_attention"
    if arch == "Gemma2ForCausalLM":
        sliding = (layer + 1) % 2 != 0
    elif arch == "Gemma3ForCausalLM":
        sliding = (layer + 1) % int(cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6))) != 0
    elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        sliding = layer >= cfg.get("max_window_layers", 28)
    else:  # Mistral, Phi-3, Mixtral, Qwen3-MoE: every layer
        sliding = True
    return "sliding_attention" if sliding else "full_attention"


def _softcap(cfg: dict, key: str, default: float | None) -> float | None:
    value = cfg.get(key, default)
    return None if value is None else float(value)


def _moe(cfg: dict, arch: str, num_layers: int, source: str) -> dict:
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    top_k = cfg.get("num_experts_per_tok")
    if not experts or not top_k or not 1 <= top_k <= experts:
        raise ModelLoadError(source, f"num_experts_per_tok: {top_k!r} experts per token out of {experts!r}")
    if arch == "MixtralForCausalLM":
        return {"num_experts": experts, "num_experts_per_tok": top_k,
                "moe_intermediate_size": cfg["intermediate_size"], "norm_topk_prob": True}
    step = cfg.get("decoder_sparse_step", 1)
    dense = set(cfg.get("mlp_only_layers") or [])
    sparse = [i not in dense and step > 0 and (i + 1) % step == 0 for i in range(num_layers)]
    if not all(sparse):
        raise ModelLoadError(source, "mlp_only_layers/decoder_sparse_step: dense layers between "
                                     "mixture-of-experts layers are not supported")
    if cfg.get("shared_expert_intermediate_size"):
        raise ModelLoadError(source, "shared_expert_intermediate_size: shared experts are not supported")
    return {"num_experts": experts, "num_experts_per_tok": top_k,
            "moe_intermediate_size": cfg["moe_intermediate_size"],
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", False))}


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
    window = meta.get(f"{gguf_arch}.attention.sliding_window")
    num_layers = int(key("block_count"))
    return ModelArchConfig(
        architecture=GGUF_ARCHITECTURES[gguf_arch][0], vocab_size=int(vocab), hidden_size=int(hidden),
        intermediate_size=int(key("feed_forward_length")), num_layers=num_layers,
        num_heads=int(num_heads), num_kv_heads=int(key("attention.head_count_kv", num_heads)),
        head_dim=int(key("rope.dimension_count", hidden // num_heads)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        max_position_embeddings=int(key("context_length")),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        rope_scaling={"rope_type": "gguf_freq_factors"} if "rope_freqs.weight" in tensor_names else None,
        layer_windows=(int(window),) * num_layers if window else ())


def embedding_scale(arch: ModelArchConfig) -> float | None:
    """Gemma multiplies the embedding by sqrt(hidden_size); others do not scale it."""
    return math.sqrt(arch.hidden_size) if arch.gemma_norms else None
