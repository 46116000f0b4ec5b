"""Linear layers with their weights prepacked for oneDNN, on CPU.

A weight packed once at load time into oneDNN's blocked layout serves every row count:
decode batches (a few rows), where MKL's GEMM on a plain [out, in] weight spends much of its
time re-laying out the weight, and prefill chunks (thousands of rows), where MKL on AMD CPUs
runs its AVX2 code while oneDNN runs AVX-512. Measured on a 2-core AVX-512 EPYC (fp32,
SmolLM2's shapes): packed 2.2x F.linear at 64 rows, 2.3x at 2,048; bf16 1.2-2x at 1-64 rows,
equal at 512 and more (bf16 F.linear is oneDNN already). vLLM's CPU backend prepacks the same way.
The plain weight is kept for inputs that are not 2-D and for tied embeddings.

Decode batches of 1-4 rows in float32 take kernels/cpu/skinny_linear.cpp instead, once the
C++ kernels are loaded (`skinny = True`, set by the decoder's prepack): with so few rows a
layer is a read of its weight, and that kernel streams the plain weight at 1.5-2x the rate of
oneDNN's packed GEMM on a Zen 4 core (it prefetches further ahead).

oneDNN, MKL and the skinny kernel round differently in the last bits of float32 (a different
summation order), as any two GEMM libraries do; greedy outputs stay equal to transformers' on
the engine's correctness tests.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels.cpu import SKINNY_MAX_ROWS

_PACK_HINT_ROWS = 8  # oneDNN picks its packed layout for this row count; it serves 1-2,048 well


def can_prepack(device: torch.device | str, dtype: torch.dtype) -> bool:
    """float32, or bfloat16 where oneDNN has bf16 kernels, on a CPU: the cases measured to gain."""
    if torch.device(device).type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear(nn.Module):
    """y = x W^T + b, as nn.Linear."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_HINT_ROWS)
        self.skinny = False  # rows <= SKINNY_MAX_ROWS on kernels/cpu/skinny_linear.cpp (use_skinny_kernel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return F.linear(x, self.weight, self.bias)
        if self.skinny and x.size(0) <= SKINNY_MAX_ROWS:
            return torch.ops.pdserve.skinny_linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def use_skinny_kernel(self) -> bool:
        """Takes the skinny kernel for few rows where it applies (float32, a contiguous weight);
        the C++ kernels must be loaded. Returns whether it does."""
        self.skinny = self.weight.dtype == torch.float32 and self.weight.is_contiguous()
        return self.skinny

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
