"""Linear layers and embeddings whose weights stay in llama.cpp's GGUF blocks in memory
(`--quantization gguf`): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (4.5-8.5 bits a weight) and the K-quants
Q4_K and Q6_K (4.5 and 6.56 bits) that llama.cpp's Q4_K_M / Q6_K files are made of (with
Q5_0/Q8_0 where a row does not hold whole 256-column blocks).

Each weight row is its blocks as the file stores them: 32 columns a block for Q4_0/Q4_1/Q8_0
(an fp16 scale d, for Q4_1 an fp16 offset m, then the quants: column j in the low nibble of
byte j, column j + 16 in its high nibble; Q5_0/Q5_1 add 32 high bits before the nibbles),
256 for the K-quants (kernels/cpu/gguf_linear.cpp describes their layout). The weight is held
as uint8 [out, in / block columns x block bytes], so `Module.to(dtype)` leaves it alone, and
the rows narrow for tensor parallelism and llama.cpp's Q/K row order like any weight's.

What it computes is exactly the float32 weight gguf-py's dequantizer gives (Q4_0 d (q - 8),
Q4_1 d q + m, Q5_0 d (q - 16), Q5_1 d q + m, Q8_0 q d, Q4_K (d sc) q - dmin m, Q6_K
(d sc) (q - 32)) times x, which is what the engine computed before it kept the blocks:
- decode batches of 1-8 float32 rows on a CPU: kernels/cpu/gguf_linear.cpp's kernel,
  4 rows a call, reading the blocks and dequantizing 16 or 32 columns at a time in registers
  (the result is skinny_linear's over the dequantized weight, bit for bit);
- larger batches on a CPU: the C++ dequantizer into a float32 temporary, then the float32 GEMM;
- elsewhere (a GPU, or without the C++ kernels): the torch dequantization below.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.errors import ModelLoadError
from pdserve.kernels.cpu import GGUF_BLOCKS, SKINNY_MAX_ROWS, gguf_columns

# ggml type ids kept in their blocks, by name (gguf.GGMLQuantizationType)
KEPT_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14}
TYPE_NAMES = {value: name for name, value in KEPT_TYPES.items()}
# batches of up to this many groups of SKINNY_MAX_ROWS rows run the row kernel once a group
# (the weight's blocks read that many times); larger ones dequantize the weight once
SKINNY_GROUPS = 2


def block_columns(ggml_type: int) -> int:
    return GGUF_BLOCKS[ggml_type][0]


def row_bytes(in_features: int, ggml_type: int) -> int:
    columns, block_bytes = GGUF_BLOCKS[ggml_type]
    return in_features // columns * block_bytes


def narrow_gguf_columns(blocks: torch.Tensor, ggml_type: int, start: int, length: int, name: str) -> torch.Tensor:
    """Columns start..start+length of GGUF blocks [rows, bytes]: whole blocks only."""
    columns, block_bytes = GGUF_BLOCKS[ggml_type]
    if start % columns or length % columns:
        raise ModelLoadError(name, f"quantization: 'gguf' keeps {TYPE_NAMES[ggml_type]}'s {columns}-column blocks, "
                                   f"and this rank's columns {start}-{start + length} do not fall on them; choose a "
                                   "tensor-parallel size that splits on them, or leave quantization unset")
    return blocks.narrow(1, start // columns * block_bytes, length // columns * block_bytes)


def dequantize_torch(weight: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """The float32 weight of GGUF blocks [rows, blocks x bytes], on the weight's device, as
    gguf-py computes it (each product and sum rounded once)."""
    rows = weight.shape[0]
    blocks = weight.reshape(rows, -1, GGUF_BLOCKS[ggml_type][1])
    if ggml_type == KEPT_TYPES["Q4_K"]:
        return _dequantize_q4_k(blocks).reshape(rows, -1)
    if ggml_type == KEPT_TYPES["Q6_K"]:
        return _dequantize_q6_k(blocks).reshape(rows, -1)
    if ggml_type in (KEPT_TYPES["Q5_0"], KEPT_TYPES["Q5_1"]):
        return _dequantize_q5(blocks, ggml_type).reshape(rows, -1)
    d = _fp16(blocks, 0)
    if ggml_type == KEPT_TYPES["Q8_0"]:
        return (blocks[..., 2:].contiguous().view(torch.int8).float() * d).reshape(rows, -1)
    offset = 4 if ggml_type == KEPT_TYPES["Q4_1"] else 2
    quants = blocks[..., offset:]
    q = torch.cat([quants & 0x0F, quants >> 4], dim=-1).float()
    if ggml_type == KEPT_TYPES["Q4_0"]:
        return (d * (q - 8)).reshape(rows, -1)
    return (d * q + _fp16(blocks, 2)).reshape(rows, -1)


def _fp16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 at byte `offset` of each block, as float32 [rows, blocks, 1]."""
    return blocks[..., offset:offset + 2].contiguous().view(torch.float16).float()


def _dequantize_q5(blocks: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """[rows, blocks, 22 or 24] -> [rows, blocks, 32]: d (q - 16) or d q + m, q's fifth bit
    from the block's little-endian uint32 of high bits."""
    high_at = 2 if ggml_type == KEPT_TYPES["Q5_0"] else 4
    high = blocks[..., high_at:high_at + 4].to(torch.int64)
    high = high[..., 0:1] | high[..., 1:2] << 8 | high[..., 2:3] << 16 | high[..., 3:4] << 24
    bits = (high >> torch.arange(32, device=blocks.device)) & 1
    nibbles = blocks[..., high_at + 4:]
    q = (torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).to(torch.int64) | bits << 4).float()
    if ggml_type == KEPT_TYPES["Q5_0"]:
        return _fp16(blocks, 0) * (q - 16)
    return _fp16(blocks, 0) * q + _fp16(blocks, 2)


def _dequantize_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    """[rows, blocks, 144] -> [rows, blocks, 8, 32]: (d sc) q - (dmin m) per 32 columns."""
    d, dmin, packed, quants = _fp16(blocks, 0), _fp16(blocks, 2), blocks[..., 4:16], blocks[..., 16:]
    low, high, top = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]  # ggml's get_scale_min_k4
    scales = torch.cat([low & 63, (top & 0x0F) | ((low >> 2) & 0x30)], dim=-1).float()
    mins = torch.cat([high & 63, (top >> 4) | ((high >> 2) & 0x30)], dim=-1).float()
    quants = quants.reshape(*quants.shape[:-1], 4, 1, 32)
    q = torch.cat([quants & 0x0F, quants >> 4], dim=-2).reshape(*quants.shape[:-3], 8, 32).float()
    return (d * scales).unsqueeze(-1) * q - (dmin * mins).unsqueeze(-1)


def _dequantize_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """[rows, blocks, 210] -> [rows, blocks, 16, 16]: (d sc) (q - 32) per 16 columns."""
    low, high = blocks[..., :128], blocks[..., 128:192]
    scales = blocks[..., 192:208].contiguous().view(torch.int8).float()
    lead = blocks.shape[:-1]
    low = low.reshape(*lead, 2, 1, 64)
    low = torch.cat([low & 0x0F, low >> 4], dim=-2).reshape(*lead, 8, 32)
    high = high.reshape(*lead, 2, 1, 32)
    high = torch.cat([(high >> shift) & 3 for shift in (0, 2, 4, 6)], dim=-2).reshape(*lead, 8, 32)
    q = ((low | (high << 4)).to(torch.int32) - 32).reshape(*lead, 16, 16).float()
    return (_fp16(blocks, 208) * scales).unsqueeze(-1) * q


def _dequantized(weight: torch.Tensor, ggml_type: int, kernel: bool) -> torch.Tensor:
    if not kernel:
        return dequantize_torch(weight, ggml_type)
    out = torch.empty(weight.shape[0], gguf_columns(weight.shape[1], ggml_type), dtype=torch.float32)
    torch.ops.pdserve.dequantize_gguf(out, weight, ggml_type)
    return out


class GGUFLinear(nn.Module):
    """y = x W^T + b, W kept in GGUF blocks of `ggml_type`."""

    def __init__(self, in_features: int, out_features: int, bias: bool, ggml_type: int):
        super().__init__()
        if in_features % block_columns(ggml_type):
            raise ValueError(f"in_features: {TYPE_NAMES[ggml_type]} blocks hold {block_columns(ggml_type)} columns, "
                             f"got {in_features}")
        self.in_features, self.out_features, self.ggml_type = in_features, out_features, ggml_type
        self.weight = nn.Parameter(torch.empty(out_features, row_bytes(in_features, ggml_type), dtype=torch.uint8),
                                   requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.kernel = False  # on the C++ GGUF ops (use_skinny_kernel)

    @classmethod
    def sharing(cls, embedding: "GGUFEmbedding") -> "GGUFLinear":
        """The LM head tied to a GGUF embedding: the same blocks, not a copy."""
        head = cls(embedding.embedding_dim, embedding.num_embeddings, False, embedding.ggml_type)
        head.weight = embedding.weight
        return head

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return _dequantized(self.weight, self.ggml_type, self.kernel).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self.kernel and x.dim() == 2 and x.size(0) <= SKINNY_GROUPS * SKINNY_MAX_ROWS
                and x.dtype == torch.float32 and (self.bias is None or self.bias.dtype == torch.float32)):
            if x.size(0) <= SKINNY_MAX_ROWS:
                return self._rows(x)
            return torch.cat([self._rows(part) for part in x.split(SKINNY_MAX_ROWS)])
        return F.linear(x, self.dequantized(x.dtype), self.bias)

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.pdserve.skinny_linear_gguf(x, self.weight, self.ggml_type, self.bias)

    def use_skinny_kernel(self) -> bool:
        """Takes the C++ GGUF ops for a CPU weight (the C++ kernels must be loaded)."""
        self.kernel = self.weight.device.type == "cpu"
        return self.kernel

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, GGUF {TYPE_NAMES[self.ggml_type]}"


class GGUFEmbedding(nn.Module):
    """An embedding table kept in GGUF blocks: the rows looked up are dequantized alone, into
    `dtype` (the model's, set by the loader)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, ggml_type: int):
        super().__init__()
        if embedding_dim % block_columns(ggml_type):
            raise ValueError(f"embedding_dim: {TYPE_NAMES[ggml_type]} blocks hold {block_columns(ggml_type)} columns, "
                             f"got {embedding_dim}")
        self.num_embeddings, self.embedding_dim, self.ggml_type = num_embeddings, embedding_dim, ggml_type
        self.weight = nn.Parameter(torch.empty(num_embeddings, row_bytes(embedding_dim, ggml_type),
                                               dtype=torch.uint8), requires_grad=False)
        self.dtype = torch.float32
        self.kernel = False

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight.index_select(0, input_ids.reshape(-1))
        x = _dequantized(rows, self.ggml_type, self.kernel).to(self.dtype)
        return x.reshape(*input_ids.shape, self.embedding_dim)

    def use_skinny_kernel(self) -> bool:
        self.kernel = self.weight.device.type == "cpu"
        return self.kernel

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, GGUF {TYPE_NAMES[self.ggml_type]}"
