"""Each supported architecture as one row of features (engine/model/arch.py reads them).

Every architecture runs on the one decoder (engine/model/decoder.py); a row says which
of its features the architecture switches on and which defaults transformers assumes
where a config.json leaves a field out. A new architecture is a new row; a feature no
row can express yet is a new field, read in one place in arch.py.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pdserve.engine.errors import ModelLoadError


def _every_layer(cfg: dict, layer: int) -> bool:
    return True


def _gemma2_layers(cfg: dict, layer: int) -> bool:
    return (layer + 1) % 2 != 0  # local, global, local, ...


def _gemma3_layers(cfg: dict, layer: int) -> bool:
    """One global layer in every `sliding_window_pattern`, the last of each run."""
    pattern = cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6))
    return (layer + 1) % int(pattern) != 0


def _qwen_layers(cfg: dict, layer: int) -> bool:
    return layer >= cfg.get("max_window_layers", 28)


def _mixtral_experts(cfg: dict, num_layers: int, source: str) -> dict:
    # each expert is the dense MLP's size, and the top-k weights always sum to 1
    return {"moe_intermediate_size": cfg["intermediate_size"], "norm_topk_prob": True}


def _qwen3_moe_experts(cfg: dict, num_layers: int, source: str) -> dict:
    step = cfg.get("decoder_sparse_step", 1)
    dense = set(cfg.get("mlp_only_layers") or [])
    if not all(i not in dense and step > 0 and (i + 1) % step == 0 for i in range(num_layers)):
        raise ModelLoadError(source, "mlp_only_layers/decoder_sparse_step: dense layers between "
                                     "mixture-of-experts layers are not supported")
    if cfg.get("shared_expert_intermediate_size"):
        raise ModelLoadError(source, "shared_expert_intermediate_size: shared experts are not supported")
    return {"moe_intermediate_size": cfg["moe_intermediate_size"],
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", False))}


@dataclass(frozen=True)
class ArchitectureFeatures:
    """One architecture. The defaults are Llama's: a row names only where it differs."""

    # transformers' defaults where config.json leaves the field out
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: int | None = None             # when config.json has no `sliding_window` at all
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    # read from config.json (this its default) only where not None: other architectures
    # scale by head_dim ** -0.5 whatever their config says
    query_pre_attn_scalar: float | None = None
    # the decoder's features
    qk_norm: bool = False
    gemma_norms: bool = False                     # (1 + w) and sandwich norms, scaled embedding
    # not None: windowed layers rotate with their own base, this its default
    local_rope_theta: float | None = None
    # rope types that old configs wrote for what transformers now calls longrope
    longrope_aliases: tuple[str, ...] = ()
    # without `layer_types` in the config: whether a layer is windowed (when there is a window)
    sliding_layer: Callable[[dict, int], bool] = _every_layer
    # None: a dense MLP; else reads the experts' size and top-k normalisation from config.json
    experts: Callable[[dict, int, str], dict] | None = None
    # llama.cpp's name for it (`general.architecture`), and whether its converter permuted
    # the Q/K rows into its interleaved RoPE layout (the reader undoes that)
    gguf_name: str | None = None
    gguf_qk_permuted: bool = False


ARCHITECTURE_FEATURES: dict[str, ArchitectureFeatures] = {
    "LlamaForCausalLM": ArchitectureFeatures(gguf_name="llama", gguf_qk_permuted=True),
    "MistralForCausalLM": ArchitectureFeatures(),
    "Qwen2ForCausalLM": ArchitectureFeatures(attention_bias=True, sliding_layer=_qwen_layers, gguf_name="qwen2"),
    "Qwen3ForCausalLM": ArchitectureFeatures(qk_norm=True, sliding_layer=_qwen_layers),
    "Gemma2ForCausalLM": ArchitectureFeatures(
        max_position_embeddings=8192, hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True,
        sliding_window=4096, attn_logit_softcap=50.0, final_logit_softcap=30.0, query_pre_attn_scalar=256.0,
        gemma_norms=True, sliding_layer=_gemma2_layers),
    "Gemma3ForCausalLM": ArchitectureFeatures(
        max_position_embeddings=131072, rope_theta=1_000_000.0, hidden_act="gelu_pytorch_tanh",
        tie_word_embeddings=True, sliding_window=4096, query_pre_attn_scalar=256.0, qk_norm=True,
        gemma_norms=True, local_rope_theta=10000.0, sliding_layer=_gemma3_layers),
    "Phi3ForCausalLM": ArchitectureFeatures(max_position_embeddings=4096, longrope_aliases=("su", "yarn")),
    "MixtralForCausalLM": ArchitectureFeatures(
        max_position_embeddings=131072, rope_theta=1_000_000.0, experts=_mixtral_experts),
    "Qwen3MoeForCausalLM": ArchitectureFeatures(qk_norm=True, experts=_qwen3_moe_experts),
}



def gguf_architectures() -> dict[str, str]:
    """llama.cpp's architecture name -> ours."""
    return {f.gguf_name: name for name, f in ARCHITECTURE_FEATURES.items() if f.gguf_name}
