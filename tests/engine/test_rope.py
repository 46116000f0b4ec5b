"""RoPE schemes checked against transformers' own rotary embedding modules and
apply_rotary_pos_emb: our rotated q/k at every position of the table, float32, within 1e-5.

Full rotary goes through Llama's module (Qwen3, Mistral and Mixtral share it); partial
rotary through Phi-3's and GPT-NeoX's, whose apply_rotary_pos_emb rotates the first
rotary_dim dims and passes the rest through."""
from __future__ import annotations

import copy
import math

import pytest
import torch

from pdserve.engine.errors import ModelLoadError
from pdserve.engine.model.rope import RotaryEmbedding

HEAD_DIM, HEADS, KV_HEADS = 64, 4, 2
THETA = 10000.0
ORIGINAL, MAX_PE = 64, 256  # pretraining length, the config's max_position_embeddings


def _llama(rope: dict, max_pe: int):
    from transformers import LlamaConfig
    from transformers.models.llama import modeling_llama as m
    cfg = LlamaConfig(hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                      head_dim=HEAD_DIM, max_position_embeddings=max_pe, rope_parameters=rope)
    return m.LlamaRotaryEmbedding(cfg), m.apply_rotary_pos_emb


def _phi3(rope: dict, max_pe: int, partial: float, original: int | None = None):
    from transformers import Phi3Config
    from transformers.models.phi3 import modeling_phi3 as m
    extra = {"original_max_position_embeddings": original} if original else {}
    cfg = Phi3Config(hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                     max_position_embeddings=max_pe, partial_rotary_factor=partial, rope_parameters=rope, **extra)
    return m.Phi3RotaryEmbedding(cfg), m.apply_rotary_pos_emb


def _neox(rope: dict, max_pe: int, partial: float):
    from transformers import GPTNeoXConfig
    from transformers.models.gpt_neox import modeling_gpt_neox as m
    cfg = GPTNeoXConfig(hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS, max_position_embeddings=max_pe,
                        rotary_pct=partial, rope_parameters=rope)
    return m.GPTNeoXRotaryEmbedding(cfg), m.apply_rotary_pos_emb


def _hf_rotate(hf, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
    """transformers' layout: [batch, heads, T, d]; ours [T, heads, d]."""
    rotary, apply = hf
    cos, sin = rotary(q, positions[None])
    q_hf, k_hf = apply(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    return q_hf[0].transpose(0, 1), k_hf[0].transpose(0, 1)


def _qk(num_positions: int):
    gen = torch.Generator().manual_seed(num_positions)
    return (torch.randn(num_positions, HEADS, HEAD_DIM, generator=gen),
            torch.randn(num_positions, KV_HEADS, HEAD_DIM, generator=gen))


def _check(hf, rope: dict, num_positions: int, partial: float = 1.0, max_pe: int = MAX_PE,
           extra_scaling: dict | None = None) -> None:
    """The engine gets the config's rope dict less rope_theta (engine/model/arch.py)."""
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"} | (extra_scaling or {})
    ours = RotaryEmbedding(HEAD_DIM, THETA, scaling, num_positions, partial_rotary_factor=partial,
                           max_position_embeddings=max_pe)
    positions = torch.arange(num_positions)
    q, k = _qk(num_positions)
    with torch.no_grad():
        q_hf, k_hf = _hf_rotate(hf, positions, q, k)
    q_ours, k_ours = ours(positions, q, k)
    assert (q_ours - q_hf).abs().max() < 1e-5
    assert (k_ours - k_hf).abs().max() < 1e-5


def _rope(**fields) -> dict:
    return {"rope_theta": THETA, **fields}


# positions run to MAX_PE, four times the pretraining length, for the static schemes
FULL_ROTARY = {
    "default": _rope(rope_type="default"),
    "linear": _rope(rope_type="linear", factor=4.0),
    "legacy_type_key": _rope(type="linear", factor=2.0),
    "llama3": _rope(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=ORIGINAL),
    "yarn": _rope(rope_type="yarn", factor=4.0, original_max_position_embeddings=ORIGINAL),
    "yarn_attention_factor": _rope(rope_type="yarn", factor=4.0, original_max_position_embeddings=ORIGINAL,
                                   attention_factor=0.8),
    "yarn_mscale": _rope(rope_type="yarn", factor=40.0, original_max_position_embeddings=ORIGINAL,
                         mscale=1.0, mscale_all_dim=0.707, beta_fast=16, beta_slow=2),
    "yarn_mscale_alone": _rope(rope_type="yarn", factor=4.0, original_max_position_embeddings=ORIGINAL, mscale=0.5),
    "yarn_no_truncate": _rope(rope_type="yarn", factor=32.0, original_max_position_embeddings=ORIGINAL,
                              truncate=False),
    "yarn_original_from_max_pe": _rope(rope_type="yarn", factor=2.0),
}


@pytest.mark.parametrize("name", FULL_ROTARY)
def test_static_schemes_match_transformers(name):
    rope = FULL_ROTARY[name]
    _check(_llama(copy.deepcopy(rope), MAX_PE), rope, MAX_PE)


def test_dynamic_within_max_position_embeddings_is_default_rope():
    rope = _rope(rope_type="dynamic", factor=2.0)
    _check(_llama(copy.deepcopy(rope), MAX_PE), rope, MAX_PE)


def _longrope(dim: int, **fields) -> dict:
    gen = torch.Generator().manual_seed(dim)
    short = (1 + torch.rand(dim // 2, generator=gen)).tolist()
    long = (1 + 4 * torch.rand(dim // 2, generator=gen)).tolist()
    return _rope(rope_type="longrope", short_factor=short, long_factor=long, **fields)


@pytest.mark.parametrize("fields", [{}, {"factor": 8.0}, {"attention_factor": 1.3}])
def test_longrope_within_original_length(fields):
    rope = _longrope(HEAD_DIM, original_max_position_embeddings=ORIGINAL, **fields)
    _check(_llama(copy.deepcopy(rope), MAX_PE), rope, ORIGINAL)


@pytest.mark.parametrize("partial", [0.5, 0.75])
def test_partial_rotary_matches_phi3(partial):
    rope = _rope(rope_type="default")
    _check(_phi3(copy.deepcopy(rope), MAX_PE, partial), rope, MAX_PE, partial)


def test_partial_longrope_matches_phi4_mini_style():
    """Phi-3/Phi-4-mini keep original_max_position_embeddings at the top of config.json;
    transformers moves it into the rope dict, and so must whoever builds `scaling`."""
    rope = _longrope(int(HEAD_DIM * 0.75))
    _check(_phi3(copy.deepcopy(rope), MAX_PE, 0.75, original=ORIGINAL), rope, ORIGINAL, 0.75,
           extra_scaling={"original_max_position_embeddings": ORIGINAL})


def test_partial_yarn_matches_gpt_neox():
    rope = _rope(rope_type="yarn", factor=4.0, original_max_position_embeddings=ORIGINAL)
    _check(_neox(copy.deepcopy(rope), MAX_PE, 0.5), rope, MAX_PE, 0.5)


def test_yarn_attention_factor_defaults():
    def factor_of(**fields):
        return RotaryEmbedding(HEAD_DIM, THETA, {"rope_type": "yarn", "original_max_position_embeddings": ORIGINAL,
                                                 **fields}, 8).attention_factor
    assert factor_of(factor=4.0) == pytest.approx(0.1 * math.log(4.0) + 1)
    assert factor_of(factor=4.0, attention_factor=0.8) == 0.8
    assert factor_of(factor=4.0, mscale=1.0, mscale_all_dim=1.0) == pytest.approx(1.0)


def _refusal(scaling: dict, max_positions: int, **kwargs) -> str:
    with pytest.raises(ModelLoadError) as err:
        RotaryEmbedding(HEAD_DIM, THETA, scaling, max_positions, **kwargs)
    assert err.value.source == "rope_scaling"
    return str(err.value)


def test_dynamic_beyond_max_position_embeddings_is_refused():
    message = _refusal({"rope_type": "dynamic", "factor": 2.0}, MAX_PE + 1, max_position_embeddings=MAX_PE)
    assert f"max_model_len <= {MAX_PE}" in message


def test_longrope_beyond_original_length_is_refused():
    scaling = {k: v for k, v in _longrope(HEAD_DIM, original_max_position_embeddings=ORIGINAL).items()
               if k != "rope_theta"}
    message = _refusal(scaling, ORIGINAL + 1, max_position_embeddings=MAX_PE)
    assert f"max_model_len <= {ORIGINAL}" in message and "long_factor" in message


def test_unknown_rope_type_is_refused_listing_supported():
    message = _refusal({"rope_type": "ntk-by-parts", "factor": 2.0}, 16)
    assert "ntk-by-parts" in message
    for kind in ("default", "linear", "llama3", "yarn", "dynamic", "longrope"):
        assert kind in message


def test_transformers_changes_dynamic_and_longrope_past_the_bound():
    """Why those two are refused: past the bound, transformers rotates position 0 (a
    cached key) differently from how it did while the sequence was short."""
    for rope, bound in ((_rope(rope_type="dynamic", factor=2.0), MAX_PE),
                        (_longrope(HEAD_DIM, original_max_position_embeddings=ORIGINAL), ORIGINAL)):
        rotary, _ = _llama(copy.deepcopy(rope), MAX_PE)
        x = torch.zeros(1)
        short_cos, _ = rotary(x, torch.arange(bound)[None])
        long_cos, _ = rotary(x, torch.arange(bound + 1)[None])
        assert not torch.allclose(short_cos[0, 1], long_cos[0, 1])


def test_gguf_freq_factors_divide_inv_freq():
    ours = RotaryEmbedding(HEAD_DIM, THETA, {"rope_type": "gguf_freq_factors"}, MAX_PE)
    ours.apply_freq_factors(torch.full((HEAD_DIM // 2,), 4.0))
    linear = RotaryEmbedding(HEAD_DIM, THETA, {"rope_type": "linear", "factor": 4.0}, MAX_PE)
    assert torch.equal(ours.cos_table, linear.cos_table) and torch.equal(ours.sin_table, linear.sin_table)


def test_odd_rotary_dim_is_refused():
    with pytest.raises(ModelLoadError, match="partial_rotary_factor"):
        RotaryEmbedding(HEAD_DIM, THETA, None, 16, partial_rotary_factor=0.3)


def test_longrope_without_original_length_is_refused():
    """transformers' Phi3Config defaults it to 4096 and reads it from the top level; a
    fallback to max_position_embeddings would be silently wrong for every Phi-3."""
    scaling = {k: v for k, v in _longrope(HEAD_DIM).items() if k != "rope_theta"}
    assert "original_max_position_embeddings" in _refusal(scaling, 16, max_position_embeddings=MAX_PE)
