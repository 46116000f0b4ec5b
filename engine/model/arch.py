"""Reading a decoder's shape from config.json or from GGUF metadata.

Every architecture is this engine's one decoder (engine/model/decoder.py) with features
switched on by the config: a windowed layer, q/k norms, Gemma's norms and soft-caps, a
mixture of experts. What differs between architectures is their row in
engine/model/arch_table.py, never a branch here. A config field this engine cannot
honour is refused here, naming the field, rather than loaded and answered wrongly.
"""
from __future__ import annotations

import math

from pdserve.engine.config import ModelArchConfig
from pdserve.engine.errors import ModelLoadError
from pdserve.engine.model.arch_table import ARCHITECTURE_FEATURES, ArchitectureFeatures, gguf_architectures

ACTIVATIONS = {"silu", "gelu_pytorch_tanh"}


def arch_from_hf_config(cfg: dict, source: str) -> ModelArchConfig:
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in ARCHITECTURE_FEATURES), None)
    if arch is None:
        raise ModelLoadError(source, f"architectures: unsupported {archs}; supported: "
                                     f"{sorted(ARCHITECTURE_FEATURES)}")
    try:
        return _read(cfg, arch, ARCHITECTURE_FEATURES[arch], source)
    except KeyError as e:
        raise ModelLoadError(source, f"config.json lacks {e.args[0]!r}") from None


def _read(cfg: dict, arch: str, f: ArchitectureFeatures, source: str) -> ModelArchConfig:
    num_heads, num_layers = cfg["num_attention_heads"], cfg["num_hidden_layers"]
    global_rope, local_theta = _rope(cfg, f, source)
    theta = global_rope.pop("rope_theta")
    partial = float(global_rope.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    if not 0.0 < partial <= 1.0:
        raise ModelLoadError(source, f"partial_rotary_factor: must be in (0, 1], got {partial}")
    scaling = global_rope if global_rope.get("rope_type", global_rope.get("type", "default")) != "default" else None
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or f.hidden_act
    if act not in ACTIVATIONS:
        raise ModelLoadError(source, f"hidden_act: {act!r} is not supported (supported: {sorted(ACTIVATIONS)})")
    if cfg.get("use_bidirectional_attention"):
        raise ModelLoadError(source, "use_bidirectional_attention: bidirectional (embedding) models are not served")
    moe = _moe(cfg, f, num_layers, source)
    return ModelArchConfig(
        architecture=arch, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"], num_layers=num_layers,
        num_heads=num_heads, num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
        max_position_embeddings=cfg.get("max_position_embeddings", f.max_position_embeddings),
        tie_word_embeddings=cfg.get("tie_word_embeddings", f.tie_word_embeddings),
        attention_bias=cfg.get("attention_bias", f.attention_bias),
        rope_scaling=scaling, layer_windows=_layer_windows(cfg, f, num_layers, source),
        qk_norm=f.qk_norm, gemma_norms=f.gemma_norms, hidden_act=act,
        attn_logit_softcap=_softcap(cfg, "attn_logit_softcapping", f.attn_logit_softcap),
        final_logit_softcap=_softcap(cfg, "final_logit_softcapping", f.final_logit_softcap),
        query_pre_attn_scalar=None if f.query_pre_attn_scalar is None
        else float(cfg.get("query_pre_attn_scalar", f.query_pre_attn_scalar)),
        local_rope_theta=local_theta, partial_rotary_factor=partial, **moe)


def _rope(cfg: dict, f: ArchitectureFeatures, source: str) -> tuple[dict, float | None]:
    """(the global layers' rope dict with rope_theta, the windowed layers' own base or None).
    transformers 5 writes `rope_parameters` (Gemma 3: one per layer type); older configs
    `rope_theta` and `rope_scaling` (Gemma 3: `rope_local_base_freq` for local layers)."""
    params = cfg.get("rope_parameters") or {}
    if f.local_rope_theta is not None:
        if "full_attention" in params or "sliding_attention" in params:
            local = dict(params.get("sliding_attention") or {})
            if local.get("rope_type", "default") != "default":
                raise ModelLoadError(source, f"rope_parameters: sliding_attention rope type "
                                             f"{local['rope_type']!r} is not supported (only default)")
            glob = dict(params.get("full_attention") or {})
            glob.setdefault("rope_theta", cfg.get("rope_theta", f.rope_theta))
            return glob, float(local.get("rope_theta", cfg.get("rope_local_base_freq", f.local_rope_theta)))
        local_theta = float(cfg.get("rope_local_base_freq", f.local_rope_theta))
    else:
        local_theta = None
    rope = dict(params or cfg.get("rope_scaling") or {})
    rope["rope_theta"] = cfg.get("rope_theta") or rope.get("rope_theta") or f.rope_theta
    if "original_max_position_embeddings" in cfg:  # Phi-3 keeps it beside rope_scaling; it wins there
        rope["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
    kind = rope.get("rope_type", rope.get("type"))
    if kind in f.longrope_aliases:
        rope["rope_type"] = "longrope"
        rope.pop("type", None)
    return rope, local_theta


def _layer_windows(cfg: dict, f: ArchitectureFeatures, num_layers: int, source: str) -> tuple[int | None, ...]:
    """Each layer's attention window as transformers builds its masks: `layer_types` when
    the config lists them, else each architecture's rule."""
    window = cfg.get("sliding_window")
    if "use_sliding_window" in cfg and not cfg["use_sliding_window"]:
        window = None  # Qwen2/Qwen3: the field is there, switched off
    if "sliding_window" not in cfg:
        window = f.sliding_window
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ModelLoadError(source, f"sliding_window: must be a positive integer, got {window!r}")
    types = cfg.get("layer_types")
    if types is None:
        types = ["sliding_attention" if window is not None and f.sliding_layer(cfg, i) else "full_attention"
                 for i in range(num_layers)]
    if len(types) != num_layers:
        raise ModelLoadError(source, f"layer_types: {len(types)} entries for {num_layers} layers")
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ModelLoadError(source, f"layer_types: {unknown} not supported (full_attention, sliding_attention)")
    if window is None or "sliding_attention" not in types:
        return ()
    return tuple(window if t == "sliding_attention" else None for t in types)


def _softcap(cfg: dict, key: str, default: float | None) -> float | None:
    value = cfg.get(key, default)
    return None if value is None else float(value)


def _moe(cfg: dict, f: ArchitectureFeatures, num_layers: int, source: str) -> dict:
    if f.experts is None:
        return {}
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    top_k = cfg.get("num_experts_per_tok")
    if not experts or not top_k or not 1 <= top_k <= experts:
        raise ModelLoadError(source, f"num_experts_per_tok: {top_k!r} experts per token out of {experts!r}")
    return {"num_experts": experts, "num_experts_per_tok": top_k, **f.experts(cfg, num_layers, source)}


def arch_from_gguf_metadata(meta: dict, tensor_names: set[str], source: str) -> ModelArchConfig:
    gguf_arch, ours = meta.get("general.architecture"), gguf_architectures()
    if gguf_arch not in ours:
        raise ModelLoadError(source, f"unsupported GGUF architecture {gguf_arch!r}; "
                                     f"supported: {sorted(ours)}")

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
        architecture=ours[gguf_arch], vocab_size=int(vocab), hidden_size=int(hidden),
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
