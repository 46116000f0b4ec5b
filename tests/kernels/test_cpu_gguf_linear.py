"""skinny_linear_gguf and dequantize_gguf (kernels/cpu/gguf_linear.cpp) and GGUFLinear /
GGUFEmbedding (engine/model/gguf_linear.py) over blocks gguf-py quantizes (the K-quants:
tests/gguf_models.py's quantizer, gguf-py has none): the weight they compute with is gguf-py's
dequantized weight bit for bit, and so is the torch reference."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from pdserve.engine.model.gguf_linear import (KEPT_TYPES, GGUFEmbedding, GGUFLinear, block_columns,
                                              dequantize_torch, narrow_gguf_columns)
from pdserve.engine.errors import ModelLoadError
from pdserve.kernels.cpu import SKINNY_MAX_ROWS, dequantize_gguf, skinny_linear, skinny_linear_gguf
from tests.gguf_models import quantize_k

TYPES = sorted(KEPT_TYPES)


def _columns(kind: str, k_len: int) -> int:
    """k_len for 32-column blocks; as many blocks of a K-quant's 256 columns."""
    return k_len * block_columns(KEPT_TYPES[kind]) // 32


def _blocks(kind: str, n_out: int, k_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks uint8 [n_out, bytes], gguf-py's dequantized float32 weight)."""
    w = np.random.default_rng(seed).standard_normal((n_out, k_len)).astype(np.float32)
    w[0] = 0.0  # a row of zeros: d = 0 (Q4_1: and m = 0)
    if kind.endswith("_K"):
        w[-1, :k_len // 2] *= 1e3  # K-quants: blocks of unlike ranges in one row
        blocks = quantize_k(w, kind)
    else:
        blocks = quantize(w, GGMLQuantizationType[kind])
    return torch.from_numpy(blocks.copy()), torch.from_numpy(dequantize(blocks, GGMLQuantizationType[kind]).copy())


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("k_len,n_out", [(576, 960), (1536, 5), (32, 3), (96, 1)])
def test_dequantizers_give_gguf_pys_weight_bit_for_bit(kind, k_len, n_out):
    k_len = _columns(kind, k_len)
    blocks, want = _blocks(kind, n_out, k_len, seed=k_len + n_out)
    assert torch.equal(dequantize_gguf(blocks, KEPT_TYPES[kind]), want)
    assert torch.equal(dequantize_torch(blocks, KEPT_TYPES[kind]), want)


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("rows", range(0, SKINNY_MAX_ROWS + 1))
@pytest.mark.parametrize("k_len,n_out", [(576, 960), (64, 7), (32, 1)])
def test_the_row_kernel_equals_skinny_linear_over_the_dequantized_weight_bit_for_bit(kind, rows, k_len, n_out):
    k_len = _columns(kind, k_len)
    blocks, want = _blocks(kind, n_out, k_len, seed=rows + k_len)
    x = torch.randn(rows, k_len, generator=torch.Generator().manual_seed(rows))
    got = skinny_linear_gguf(x, blocks, KEPT_TYPES[kind])
    assert torch.equal(got, skinny_linear(x, want))
    bias = torch.randn(n_out)
    assert torch.equal(skinny_linear_gguf(x, blocks, KEPT_TYPES[kind], bias), got + bias)


def _layer(kind: str, n_out: int, k_len: int) -> tuple[GGUFLinear, torch.Tensor]:
    layer = GGUFLinear(k_len, n_out, False, KEPT_TYPES[kind])
    blocks, want = _blocks(kind, n_out, k_len, seed=7)
    layer.weight.data.copy_(blocks)
    return layer, want


@pytest.mark.parametrize("kind", TYPES)
def test_the_layer_takes_the_row_kernel_up_to_8_rows_and_the_dequantized_weight_beyond(kind):
    k_len = _columns(kind, 96)
    layer, want = _layer(kind, 40, k_len)
    assert layer.use_skinny_kernel()
    for rows in (1, 4, 5, 8, 9, 64):
        x = torch.randn(rows, k_len)
        got = layer(x)
        if rows <= 8:  # each group of 4 rows as the kernel gives it
            assert torch.equal(got, torch.cat([skinny_linear(part, want) for part in x.split(SKINNY_MAX_ROWS)]))
        else:
            assert torch.equal(got, F.linear(x, want))
    x = torch.randn(3, k_len, dtype=torch.bfloat16)
    assert torch.equal(layer(x), F.linear(x, want.to(torch.bfloat16)))
    layer.kernel = False  # the torch reference (a GPU's path): the same weight
    x = torch.randn(2, k_len)
    assert torch.equal(layer(x), F.linear(x, want))


@pytest.mark.parametrize("kind", TYPES)
def test_the_embedding_dequantizes_the_rows_looked_up(kind):
    table = GGUFEmbedding(50, _columns(kind, 64), KEPT_TYPES[kind])
    blocks, want = _blocks(kind, 50, _columns(kind, 64), seed=11)
    table.weight.data.copy_(blocks)
    ids = torch.tensor([[3, 0, 49], [7, 7, 1]])
    for kernel in (False, True):
        table.kernel = kernel
        assert torch.equal(table(ids), F.embedding(ids, want))
    table.dtype = torch.bfloat16
    assert torch.equal(table(ids), F.embedding(ids, want).to(torch.bfloat16))


def test_columns_split_only_on_whole_blocks():
    blocks, want = _blocks("Q4_1", 4, 128, seed=1)
    part = narrow_gguf_columns(blocks, KEPT_TYPES["Q4_1"], 64, 64, "w")
    assert torch.equal(dequantize_torch(part.contiguous(), KEPT_TYPES["Q4_1"]), want[:, 64:])
    with pytest.raises(ModelLoadError, match="quantization: 'gguf' keeps Q4_1's 32-column blocks.*columns 16-48"):
        narrow_gguf_columns(blocks, KEPT_TYPES["Q4_1"], 16, 32, "w")
    blocks, want = _blocks("Q4_K", 4, 1024, seed=1)
    part = narrow_gguf_columns(blocks, KEPT_TYPES["Q4_K"], 512, 512, "w")
    assert torch.equal(dequantize_gguf(part.contiguous(), KEPT_TYPES["Q4_K"]), want[:, 512:])
    with pytest.raises(ModelLoadError, match="keeps Q4_K's 256-column blocks.*columns 128-640"):
        narrow_gguf_columns(blocks, KEPT_TYPES["Q4_K"], 128, 512, "w")


@pytest.mark.parametrize("x,weight,ggml_type,field", [
    (torch.randn(1, 32), torch.zeros(2, 20, dtype=torch.uint8), 10, "ggml_type"),  # Q2_K: not read here
    (torch.randn(1, 32), torch.zeros(2, 144, dtype=torch.uint8), 12, "columns"),   # a Q4_K block: 256 columns
    (torch.randn(1, 32), torch.zeros(2, 21, dtype=torch.uint8), 3, "weight"),      # not whole blocks
    (torch.randn(1, 32), torch.zeros(2, 20), 3, "weight"),                          # not bytes
    (torch.randn(1, 64), torch.zeros(2, 20, dtype=torch.uint8), 3, "columns"),     # 32 columns, x has 64
    (torch.randn(5, 32), torch.zeros(2, 20, dtype=torch.uint8), 3, "x"),           # more rows than the kernel's
    (torch.randn(1, 32, dtype=torch.float64), torch.zeros(2, 20, dtype=torch.uint8), 3, "x"),
])
def test_bad_inputs_name_what_is_wrong(x, weight, ggml_type, field):
    with pytest.raises(RuntimeError, match=field):
        skinny_linear_gguf(x, weight, ggml_type)
