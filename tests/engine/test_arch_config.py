"""Reading configs: each architecture's features as transformers reads them, and every
feature this engine cannot honour refused with the config field named."""
from __future__ import annotations

import pytest

from pdserve.engine.errors import ModelLoadError
from pdserve.engine.model.arch import arch_from_hf_config

BASE = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2)


def _read(**fields):
    return arch_from_hf_config({**BASE, **fields}, "cfg")


def _refused(match: str, **fields) -> None:
    with pytest.raises(ModelLoadError, match=match):
        _read(**fields)


def test_windows_follow_each_architectures_rule_when_layer_types_are_absent():
    assert _read(architectures=["MistralForCausalLM"], sliding_window=8).layer_windows == (8,) * 4
    assert _read(architectures=["MistralForCausalLM"], sliding_window=None).layer_windows == ()
    # Qwen2/3: off unless use_sliding_window; then layers from max_window_layers on
    assert _read(architectures=["Qwen2ForCausalLM"], sliding_window=8, use_sliding_window=False).layer_windows == ()
    assert _read(architectures=["Qwen3ForCausalLM"], sliding_window=8, use_sliding_window=True,
                 max_window_layers=2).layer_windows == (None, None, 8, 8)
    # Gemma 2 alternates from a local first layer; Gemma 3 has one global layer in `pattern`
    assert _read(architectures=["Gemma2ForCausalLM"], sliding_window=8).layer_windows == (8, None, 8, None)
    assert _read(architectures=["Gemma3ForCausalLM"], sliding_window=8,
                 sliding_window_pattern=2).layer_windows == (8, None, 8, None)
    # Gemma without the field: transformers' default window
    assert _read(architectures=["Gemma2ForCausalLM"]).layer_windows == (4096, None, 4096, None)


def test_layer_types_win_over_the_rule():
    types = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
    assert _read(architectures=["Qwen3ForCausalLM"], sliding_window=8, layer_types=types).layer_windows \
        == (None, 8, 8, None)


def test_gemma3_reads_old_and_new_rope_fields():
    old = _read(architectures=["Gemma3ForCausalLM"], rope_theta=1e6, rope_local_base_freq=10000.0,
                rope_scaling={"rope_type": "linear", "factor": 8.0})
    new = _read(architectures=["Gemma3ForCausalLM"], rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    for arch in (old, new):
        assert (arch.rope_theta, arch.local_rope_theta) == (1e6, 10000.0)
        assert arch.rope_scaling == {"rope_type": "linear", "factor": 8.0}
        assert arch.gemma_norms and arch.qk_norm and arch.tie_word_embeddings
        assert arch.hidden_act == "gelu_pytorch_tanh"  # Gemma's default activation


def test_gemma2_softcaps_default_as_transformers():
    arch = _read(architectures=["Gemma2ForCausalLM"])
    assert (arch.attn_logit_softcap, arch.final_logit_softcap, arch.query_pre_attn_scalar) == (50.0, 30.0, 256.0)
    assert _read(architectures=["Gemma2ForCausalLM"], attn_logit_softcapping=None).attn_logit_softcap is None


def test_phi3_longrope_keeps_the_top_level_original_length_and_old_names():
    arch = _read(architectures=["Phi3ForCausalLM"], original_max_position_embeddings=4096,
                 rope_scaling={"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8})
    assert arch.rope_scaling["rope_type"] == "longrope"
    assert arch.rope_scaling["original_max_position_embeddings"] == 4096


def test_experts():
    mixtral = _read(architectures=["MixtralForCausalLM"], num_local_experts=8, num_experts_per_tok=2)
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.moe_intermediate_size,
            mixtral.norm_topk_prob) == (8, 2, 128, True)
    qwen = _read(architectures=["Qwen3MoeForCausalLM"], num_experts=8, num_experts_per_tok=2,
                 moe_intermediate_size=32)
    assert (qwen.num_experts, qwen.moe_intermediate_size, qwen.norm_topk_prob) == (8, 32, False)


@pytest.mark.parametrize("match,fields", [
    ("architectures: unsupported", dict(architectures=["DeepseekV3ForCausalLM"])),
    ("hidden_act: 'relu2'", dict(architectures=["LlamaForCausalLM"], hidden_act="relu2")),
    ("layer_types: \\['chunked_attention'\\]",
     dict(architectures=["Qwen3ForCausalLM"], sliding_window=8, layer_types=["chunked_attention"] * 4)),
    ("layer_types: 2 entries for 4 layers",
     dict(architectures=["Qwen3ForCausalLM"], sliding_window=8, layer_types=["full_attention"] * 2)),
    ("sliding_window: must be a positive integer", dict(architectures=["MistralForCausalLM"], sliding_window=0)),
    ("use_bidirectional_attention", dict(architectures=["Gemma3ForCausalLM"], use_bidirectional_attention=True)),
    ("mlp_only_layers", dict(architectures=["Qwen3MoeForCausalLM"], num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=32, mlp_only_layers=[0])),
    ("mlp_only_layers/decoder_sparse_step", dict(architectures=["Qwen3MoeForCausalLM"], num_experts=4,
                                                 num_experts_per_tok=2, moe_intermediate_size=32,
                                                 decoder_sparse_step=2)),
    ("num_experts_per_tok", dict(architectures=["MixtralForCausalLM"], num_local_experts=2, num_experts_per_tok=3)),
    ("partial_rotary_factor", dict(architectures=["Phi3ForCausalLM"], partial_rotary_factor=1.5)),
    ("rope_parameters: sliding_attention rope type 'yarn'", dict(architectures=["Gemma3ForCausalLM"], rope_parameters={
        "sliding_attention": {"rope_type": "yarn", "factor": 2.0}, "full_attention": {"rope_type": "default"}})),
])
def test_unsupported_features_are_refused_naming_the_field(match, fields):
    _refused(match, **fields)


def test_unknown_rope_type_is_refused_when_the_model_is_built(tmp_path):
    from pdserve.engine.model.rope import RotaryEmbedding
    arch = _read(architectures=["LlamaForCausalLM"], rope_scaling={"rope_type": "mrope", "factor": 2.0})
    with pytest.raises(ModelLoadError, match="rope_scaling"):
        RotaryEmbedding(16, arch.rope_theta, arch.rope_scaling, 64)
