"""A linear layer whose weight stays float8_e4m3fn in memory (one byte a weight), with
float32 scales, computing weight-only: y = x (W8 * S)^T + b in the input's dtype.

The scale is held per output row and column block, `weight_scale` [rows, column blocks] with
`block_columns` columns each: one block for a per-tensor or per-channel scale (a per-tensor
scale repeated on every row, so fused q/k/v keep their three), ceil(in / block) for a
block-wise one. Rows, not row blocks: a fused or tensor-parallel part may start inside a
checkpoint's row block, and each row then keeps its own block's scale.

The weight is stored as uint8 (its bits), not as a float8 tensor: `Module.to(dtype)` casts
every floating tensor, and would turn it back into full precision.

Decode batches of 1-8 float32 rows on a CPU take kernels/cpu/skinny_linear.cpp's fp8 kernel,
4 rows a call (`skinny`, set by the decoder's prepack once the C++ kernels load): it reads
the weight's bytes and dequantizes 16 at a time in registers into exactly the float32 weight
below, so the result is skinny_linear's over the dequantized weight, bit for bit. Larger batches on a CPU
dequantize the weight with the C++ op (dequantize_fp8: the same float32 weight, 20x faster
than torch's fp8 conversion) into a temporary and multiply with the float32 GEMM; elsewhere
(a GPU) torch dequantizes. Either way the weight in memory stays one byte.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels.cpu import SKINNY_MAX_ROWS

FP8 = torch.float8_e4m3fn
# batches of up to this many groups of SKINNY_MAX_ROWS rows run the row kernel once a group
# (the weight read that many times), larger ones dequantize it once: measured on a 3072 x 576
# weight, 2-core Zen 4: 8 rows 0.41 ms in two groups against 0.76 dequantized; 32 rows 1.6
# against 1.2 ms
SKINNY_GROUPS = 2


class Fp8Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, block_columns: int | None = None):
        """`block_columns`: columns per scale block (None: one block, the whole row)."""
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.block_columns = block_columns or in_features
        num_blocks = -(-in_features // self.block_columns)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.uint8), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(out_features, num_blocks, dtype=torch.float32),
                                         requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.skinny = False  # on the C++ fp8 ops (use_skinny_kernel)

    def keep_scales_float32(self) -> None:
        """After `Module.to(dtype)`, before the weights load: the scales back to float32."""
        self.weight_scale = nn.Parameter(torch.empty(self.weight_scale.shape, dtype=torch.float32,
                                                     device=self.weight_scale.device), requires_grad=False)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        w = self.weight.view(FP8).to(torch.float32)
        scale = self.weight_scale
        if scale.shape[1] > 1:
            scale = scale.repeat_interleave(self.block_columns, dim=1)[:, :self.in_features]
        return (w * scale).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.skinny:
            if (x.dim() == 2 and x.size(0) <= SKINNY_GROUPS * SKINNY_MAX_ROWS and x.dtype == torch.float32
                    and (self.bias is None or self.bias.dtype == torch.float32)):
                if x.size(0) <= SKINNY_MAX_ROWS:
                    return self._rows(x)
                return torch.cat([self._rows(part) for part in x.split(SKINNY_MAX_ROWS)])
            w = torch.empty(self.weight.shape, dtype=torch.float32)
            torch.ops.pdserve.dequantize_fp8(w, self.weight, self.weight_scale, self.block_columns)
            return F.linear(x, w.to(x.dtype), self.bias)
        return F.linear(x, self.dequantized(x.dtype), self.bias)

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.pdserve.skinny_linear_fp8(x, self.weight, self.weight_scale, self.block_columns, self.bias)

    def use_skinny_kernel(self) -> bool:
        """Takes the C++ fp8 ops where they apply (a CPU weight, scale blocks of whole 16-column
        groups): the kernel for few float32 rows, the dequantizer for the rest. The C++ kernels
        must be loaded. Returns whether it does."""
        one_block = self.weight_scale.shape[1] == 1
        self.skinny = self.weight.device.type == "cpu" and (one_block or self.block_columns % 16 == 0)
        return self.skinny

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3, "
                f"scale blocks of {self.block_columns} columns")


def fp8_linear_like(linear: nn.Linear, block_columns: int | None) -> Fp8Linear:
    """An Fp8Linear of `linear`'s shape, on its device (meta before the weights load)."""
    with torch.device(linear.weight.device):
        return Fp8Linear(linear.in_features, linear.out_features, linear.bias is not None, block_columns)
