"""Rotary position embeddings and the context-extension schemes of HF configs.

Every scheme served here is static: one inv_freq and one attention factor for all
positions, so the cos/sin tables are built once. transformers recomputes `dynamic` and
`longrope` from the current sequence length at every forward; a KV cache keeps keys
rotated at earlier steps, so past that length no cached engine can match it token for
token. Those two are served only where transformers' frequencies never change (tables no
longer than the bound) and refused beyond it, naming the max_model_len that would work.

The float operations follow transformers' order (modeling_rope_utils.py), so the tables
agree bit for bit: at position p an inv_freq one ulp off moves the angle by p ulps.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from pdserve.engine.errors import ModelLoadError
from pdserve.kernels import cpu as cpu_ops

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")


@dataclass(frozen=True)
class RopeSpec:
    """What a scheme may read: the rotated dims per head, the config's rope dict (less
    rope_theta), the table length, and the config's max_position_embeddings."""
    dim: int
    theta: float
    scaling: dict
    max_positions: int
    max_position_embeddings: int | None = None


def _divisors(dim: int, theta: float) -> torch.Tensor:
    """theta^(2i/dim) for each rotated pair i; inv_freq is its reciprocal."""
    # explicit device: the model may be built under a meta-device context
    return theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim)


def base_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / _divisors(head_dim, theta)


def _original_max(spec: RopeSpec) -> int:
    """The pretraining length; transformers falls back to max_position_embeddings."""
    original = spec.scaling.get("original_max_position_embeddings") or spec.max_position_embeddings
    if original is None:
        raise ModelLoadError("rope_scaling", f"rope type {_kind(spec.scaling)!r} needs "
                                             "original_max_position_embeddings or max_position_embeddings")
    return int(original)


def _factor(spec: RopeSpec, original: int) -> float:
    """`factor`, else max_position_embeddings / original (transformers' fallback)."""
    factor = spec.scaling.get("factor")
    if factor is None and spec.max_position_embeddings is None:
        raise ModelLoadError("rope_scaling", f"rope type {_kind(spec.scaling)!r} needs factor "
                                             "or max_position_embeddings")
    return factor if factor is not None else spec.max_position_embeddings / original


def _refuse_beyond(spec: RopeSpec, bound: int, why: str) -> None:
    if spec.max_positions > bound:
        raise ModelLoadError("rope_scaling", f"rope type {_kind(spec.scaling)!r} {why} once a sequence "
                                             f"passes {bound} positions, which cached keys cannot follow; "
                                             f"set max_model_len <= {bound} (asked for {spec.max_positions})")


def _default(spec: RopeSpec) -> tuple[torch.Tensor, float]:
    return base_inv_freq(spec.dim, spec.theta), 1.0


def _linear(spec: RopeSpec) -> tuple[torch.Tensor, float]:
    return base_inv_freq(spec.dim, spec.theta) / spec.scaling["factor"], 1.0


def _llama3(spec: RopeSpec) -> tuple[torch.Tensor, float]:
    """Llama 3.1: low frequencies divided by `factor`, high ones kept, a smooth blend between."""
    inv_freq, s = base_inv_freq(spec.dim, spec.theta), spec.scaling
    factor, old_len = s["factor"], _original_max(spec)
    low, high = s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, blended, scaled), 1.0


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_attention_factor(s: dict, factor: float) -> float:
    if s.get("attention_factor") is not None:
        return s["attention_factor"]
    mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")
    if mscale and mscale_all_dim:  # DeepSeek: the ratio of the two
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    return _yarn_mscale(factor)


def _yarn_ramp(spec: RopeSpec, original: int) -> torch.Tensor:
    """Per pair, 0 below the dim where beta_fast rotations fit in `original` positions,
    1 above the one for beta_slow, linear between. `truncate` (default true; gpt-oss
    false) rounds that range outward to whole dims."""
    s, dim = spec.scaling, spec.dim

    def dim_of(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(spec.theta))

    low, high = dim_of(s.get("beta_fast") or 32), dim_of(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    pairs = torch.arange(dim // 2, dtype=torch.float32, device="cpu")
    return torch.clamp((pairs - low) / (high - low), 0, 1)


def _yarn(spec: RopeSpec) -> tuple[torch.Tensor, float]:
    """YaRN: fast-rotating pairs keep their frequency (extrapolate), slow ones are divided
    by `factor` (interpolate), the ramp blends between; cos/sin scaled by the attention factor."""
    original = _original_max(spec)
    factor = _factor(spec, original)
    divisors = _divisors(spec.dim, spec.theta)
    extrapolated, interpolated = 1.0 / divisors, 1.0 / (factor * divisors)
    keep = 1 - _yarn_ramp(spec, original)  # the extrapolated share, as transformers writes it
    inv_freq = interpolated * (1 - keep) + extrapolated * keep
    return inv_freq, _yarn_attention_factor(spec.scaling, factor)


def _dynamic(spec: RopeSpec) -> tuple[torch.Tensor, float]:
    """NTK-dynamic: transformers raises the base once a sequence passes
    max_position_embeddings; up to it the frequencies are exactly the default ones."""
    if spec.max_position_embeddings is None:
        raise ModelLoadError("rope_scaling", "rope type 'dynamic' needs max_position_embeddings")
    _refuse_beyond(spec, spec.max_position_embeddings, "raises its base (NTK)")
    return _default(spec)


def _longrope(spec: RopeSpec) -> tuple[torch.Tensor, float]:
    """Phi-3 LongRoPE: per-pair `short_factor` divisors while a sequence is within
    original_max_position_embeddings (`long_factor` past it: refused), and always the
    attention factor sqrt(1 + ln(factor) / ln(original)) unless one is given."""
    s, original = spec.scaling, spec.scaling.get("original_max_position_embeddings")
    if original is None:  # Phi-3 keeps it beside rope_scaling; max_position_embeddings would be wrong
        raise ModelLoadError("rope_scaling", "rope type 'longrope' needs original_max_position_embeddings "
                                             "(Phi-3 configs keep it at the top level: merge it in)")
    _refuse_beyond(spec, original, "switches from short_factor to long_factor")
    factor = _factor(spec, original)
    attention = s.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    short = torch.tensor(s["short_factor"], dtype=torch.float32, device="cpu")
    if short.shape != (spec.dim // 2,):
        raise ModelLoadError("rope_scaling", f"short_factor has {len(s['short_factor'])} entries, "
                                             f"the rotary dim {spec.dim} needs {spec.dim // 2}")
    return 1.0 / (short * _divisors(spec.dim, spec.theta)), attention


_SCHEMES = {"default": _default, "gguf_freq_factors": _default,  # GGUF factors come with the weights
            "linear": _linear, "llama3": _llama3, "yarn": _yarn, "dynamic": _dynamic, "longrope": _longrope}


def _kind(scaling: dict) -> str:
    return scaling.get("rope_type", scaling.get("type", "default"))


def rope_frequencies(spec: RopeSpec) -> tuple[torch.Tensor, float]:
    """(inv_freq over the rotated pairs, the factor cos and sin are multiplied by)."""
    scheme = _SCHEMES.get(_kind(spec.scaling))
    if scheme is None:
        raise ModelLoadError("rope_scaling", f"unsupported rope type {_kind(spec.scaling)!r} "
                                             f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    return scheme(spec)


def rotary_dim_of(head_dim: int, partial_rotary_factor: float) -> int:
    dim = int(head_dim * partial_rotary_factor)
    if dim <= 0 or dim % 2:
        raise ModelLoadError("partial_rotary_factor", f"{partial_rotary_factor} of head_dim {head_dim} "
                                                      f"rotates {dim} dims; RoPE needs a positive even count")
    return dim


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions [0, max_positions), built once from inv_freq.

    With partial_rotary_factor < 1 (Phi-3/Phi-4-mini, GPT-NeoX style) only the first
    int(head_dim * factor) dims of each head rotate, rotate_half over that slice; the rest
    pass through."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None, max_positions: int,
                 partial_rotary_factor: float = 1.0, max_position_embeddings: int | None = None):
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim_of(head_dim, partial_rotary_factor)
        self.max_positions = max_positions
        spec = RopeSpec(self.rotary_dim, theta, scaling or {}, max_positions, max_position_embeddings)
        self.inv_freq, self.attention_factor = rope_frequencies(spec)
        self._build_tables()

    def apply_freq_factors(self, factors: torch.Tensor) -> None:
        """GGUF stores Llama 3.1 scaling as per-frequency divisors (`rope_freqs.weight`)."""
        self.inv_freq = self.inv_freq / factors.float().cpu()
        self._build_tables()

    def _build_tables(self) -> None:
        positions = torch.arange(self.max_positions, dtype=torch.float32, device="cpu")
        freqs = positions[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos_table = emb.cos() * self.attention_factor
        self.sin_table = emb.sin() * self.attention_factor

    def to_device(self, device: torch.device, dtype: torch.dtype) -> None:
        self.cos_table = self.cos_table.to(device=device, dtype=dtype)
        self.sin_table = self.sin_table.to(device=device, dtype=dtype)

    fused = False  # in place by the C++ op on CPU (kernels/cpu/fused_ops.cpp): DecoderForCausalLM.prepack

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, heads, d], k: [T, kv_heads, d] -> rotated (q, k); fused, q and k themselves."""
        if self.fused and self._fusable(positions, q, k):
            cpu_ops.rotary_embedding(q, k, positions, self.cos_table, self.sin_table)
            return q, k
        cos = self.cos_table[positions].unsqueeze(1)
        sin = self.sin_table[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


    def _fusable(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> bool:
        return (positions.dtype == torch.int64 and positions.dim() == 1 and positions.is_contiguous()
                and all(x.dim() == 3 and x.stride(-1) == 1 and x.dtype == self.cos_table.dtype for x in (q, k)))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    head, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat((head * cos + _rotate_half(head) * sin, rest), dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
