"""Rotary position embeddings, including the context-extension schemes of Llama checkpoints."""
from __future__ import annotations

import math

import torch
from torch import nn

from engine.errors import ModelLoadError


def base_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    # explicit device: the model may be built under a meta-device context
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1: low frequencies divided by `factor`, high ones kept, a smooth blend between."""
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, blended, scaled)


def scaled_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = base_inv_freq(head_dim, theta)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind in ("default", "gguf_freq_factors"):  # GGUF factors are applied when loaded
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ModelLoadError("rope_scaling", f"unsupported rope type {kind!r} "
                                         "(supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions [0, max_positions), built once from inv_freq."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None, max_positions: int):
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.inv_freq = scaled_inv_freq(head_dim, theta, scaling)
        self._build_tables()

    def apply_freq_factors(self, factors: torch.Tensor) -> None:
        """GGUF stores Llama 3.1 scaling as per-frequency divisors (`rope_freqs.weight`)."""
        self.inv_freq = self.inv_freq / factors.float().cpu()
        self._build_tables()

    def _build_tables(self) -> None:
        positions = torch.arange(self.max_positions, dtype=torch.float32, device="cpu")
        freqs = positions[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos_table, self.sin_table = emb.cos(), emb.sin()

    def to_device(self, device: torch.device, dtype: torch.dtype) -> None:
        self.cos_table = self.cos_table.to(device=device, dtype=dtype)
        self.sin_table = self.sin_table.to(device=device, dtype=dtype)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, heads, d], k: [T, kv_heads, d] -> rotated (q, k)."""
        cos = self.cos_table[positions].unsqueeze(1)
        sin = self.sin_table[positions].unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
