"""The architecture table: every row is what the config reader consults, and a new
architecture needs nothing but its row."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from pdserve.engine.model.arch import arch_from_gguf_metadata, arch_from_hf_config
from pdserve.engine.model.arch_table import ARCHITECTURE_FEATURES, ArchitectureFeatures

BASE = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2)
# dense rows must ignore these
EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


def _expected_windows(row: ArchitectureFeatures, cfg: dict, window: int | None) -> tuple:
    windows = tuple(window if row.sliding_layer(cfg, i) else None for i in range(BASE["num_hidden_layers"]))
    return () if window is None or windows == (None,) * len(windows) else windows


@pytest.mark.parametrize("name", sorted(ARCHITECTURE_FEATURES))
def test_each_row_is_what_its_config_reads_as(name):
    row = ARCHITECTURE_FEATURES[name]
    cfg = {**BASE, **EXPERTS, "architectures": ["SomethingElse", name]}
    arch = arch_from_hf_config(cfg, "cfg")
    assert arch.architecture == name
    assert (arch.max_position_embeddings, arch.rope_theta, arch.hidden_act, arch.tie_word_embeddings,
            arch.attention_bias, arch.qk_norm, arch.gemma_norms, arch.attn_logit_softcap,
            arch.final_logit_softcap, arch.query_pre_attn_scalar, arch.local_rope_theta) == (
        row.max_position_embeddings, row.rope_theta, row.hidden_act, row.tie_word_embeddings,
        row.attention_bias, row.qk_norm, row.gemma_norms, row.attn_logit_softcap,
        row.final_logit_softcap, row.query_pre_attn_scalar, row.local_rope_theta)
    assert bool(arch.num_experts) == (row.experts is not None)
    assert arch.layer_windows == _expected_windows(row, cfg, row.sliding_window)
    windowed = {**cfg, "sliding_window": 8}
    assert arch_from_hf_config(windowed, "cfg").layer_windows == _expected_windows(row, windowed, 8)


def test_a_new_architecture_is_one_row(monkeypatch):
    """Every field set away from Llama's default shows in what the reader returns."""
    seen = []

    def experts(cfg, num_layers, source):
        seen.append(num_layers)
        return {"moe_intermediate_size": 48, "norm_topk_prob": False}

    row = ArchitectureFeatures(
        max_position_embeddings=777, rope_theta=123.0, hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True,
        attention_bias=True, sliding_window=8, attn_logit_softcap=5.0, final_logit_softcap=7.0,
        query_pre_attn_scalar=32.0, qk_norm=True, gemma_norms=True, local_rope_theta=99.0,
        longrope_aliases=("oldrope",), sliding_layer=lambda cfg, layer: layer % 2 == 1, experts=experts,
        gguf_name="newarch", gguf_qk_permuted=True)
    monkeypatch.setitem(ARCHITECTURE_FEATURES, "NewForCausalLM", row)
    arch = arch_from_hf_config({**BASE, **EXPERTS, "architectures": ["NewForCausalLM"], "rope_scaling": {
        "type": "oldrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}}, "cfg")
    assert (arch.max_position_embeddings, arch.rope_theta, arch.hidden_act, arch.tie_word_embeddings,
            arch.attention_bias, arch.attn_logit_softcap, arch.final_logit_softcap, arch.query_pre_attn_scalar,
            arch.qk_norm, arch.gemma_norms, arch.local_rope_theta) == (
        777, 123.0, "gelu_pytorch_tanh", True, True, 5.0, 7.0, 32.0, True, True, 99.0)
    assert arch.rope_scaling["rope_type"] == "longrope"
    assert arch.layer_windows == (None, 8, None, 8)
    assert (arch.num_experts, arch.num_experts_per_tok, arch.moe_intermediate_size, arch.norm_topk_prob,
            seen) == (4, 2, 48, False, [4])
    assert arch_from_gguf_metadata(_gguf_meta("newarch"), set(), "x.gguf").architecture == "NewForCausalLM"


def test_gguf_names_map_to_their_rows():
    for gguf_name, name in (("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM")):
        assert arch_from_gguf_metadata(_gguf_meta(gguf_name), set(), "x.gguf").architecture == name
    # llama.cpp's converter permutes Llama's Q/K rows, not Qwen2's: the loader undoes it by the row
    assert ARCHITECTURE_FEATURES["LlamaForCausalLM"].gguf_qk_permuted
    assert not ARCHITECTURE_FEATURES["Qwen2ForCausalLM"].gguf_qk_permuted


def test_the_served_architectures_page_lists_every_row():
    page = (Path(__file__).parents[2] / "docs" / "serving.md").read_text()
    documented = set(re.findall(r"^\| `(\w+ForCausalLM)`", page, re.MULTILINE))
    assert documented == set(ARCHITECTURE_FEATURES)


def _gguf_meta(name: str) -> dict:
    return {"general.architecture": name, f"{name}.embedding_length": 64, f"{name}.attention.head_count": 4,
            f"{name}.vocab_size": 100, f"{name}.block_count": 2, f"{name}.feed_forward_length": 128,
            f"{name}.attention.layer_norm_rms_epsilon": 1e-6, f"{name}.context_length": 256}
