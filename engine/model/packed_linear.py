"""Linear layers with their weights prepacked for oneDNN, for CPU decode steps.

A decode step multiplies a few rows (one per running request) by every weight matrix.
At that shape MKL's GEMM on a plain [out, in] weight spends much of its time re-laying out
the weight; oneDNN's matmul on a weight packed once at load time does not (vLLM's CPU
backend prepacks the same way). Large row counts (prefill chunks) are compute-bound and
run as fast either way, so they keep the plain weight and F.linear:

    rows <= max_packed_rows   oneDNN on the packed weight
    rows >  max_packed_rows   F.linear on the plain weight (the same as before)

The two paths round differently in the last bits of float32 (a different summation
order), as any two GEMM libraries do; greedy outputs stay equal to transformers' on the
engine's correctness tests.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Rows up to this use the packed weight: decode batches. Above it, prefill chunks.
MAX_PACKED_ROWS = 256
_PACK_HINT_ROWS = 8  # oneDNN picks its packed layout for this row count; it serves 1-256 well


def can_prepack(device: torch.device | str, dtype: torch.dtype) -> bool:
    """float32 on a CPU with oneDNN: the case measured to gain (bench/profile_step.py)."""
    return torch.device(device).type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


class PackedLinear(nn.Module):
    """y = x W^T + b, as nn.Linear; the plain weight is kept for large inputs."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_HINT_ROWS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > MAX_PACKED_ROWS or x.dim() != 2:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "PackedLinear":
        return cls(linear.weight, linear.bias)


def prepack_linears(model: nn.Module) -> int:
    """Replace every nn.Linear of `model` by a PackedLinear (idempotent); returns how many."""
    swaps = [(parent, name, child) for parent in model.modules()
             for name, child in parent.named_children() if type(child) is nn.Linear]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear.from_linear(child))
    return len(swaps)
