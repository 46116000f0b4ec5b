"""kernels/cpu/skinny_linear.cpp: F.linear for 1-4 rows of float32, streaming the plain weight."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine.model.fp8_linear import Fp8Linear
from pdserve.engine.model.packed_linear import PackedLinear
from pdserve.kernels.cpu import SKINNY_MAX_ROWS, dequantize_fp8, skinny_linear, skinny_linear_fp8


@pytest.mark.parametrize("rows", range(1, SKINNY_MAX_ROWS + 1))
@pytest.mark.parametrize("k_len,n_out", [(576, 960), (1536, 576), (577, 7), (15, 33), (64, 1), (16, 4)])
def test_equals_a_float64_linear(rows, k_len, n_out):
    g = torch.Generator().manual_seed(rows * 1000 + k_len + n_out)
    x, w, b = (torch.randn(rows, k_len, generator=g), torch.randn(n_out, k_len, generator=g),
               torch.randn(n_out, generator=g))
    exact = F.linear(x.double(), w.double(), b.double())
    for bias in (b, None):
        got = skinny_linear(x, w, bias)
        want = exact if bias is not None else exact - b.double()
        assert got.shape == (rows, n_out) and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-5 * k_len ** 0.5 * 4)


def test_each_row_is_independent_of_the_others_and_of_the_thread_count():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(4, 576, generator=g), torch.randn(3072, 576, generator=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = skinny_linear(x, w)
        torch.set_num_threads(2)
        two = skinny_linear(x, w)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    for r in range(4):  # a sequence's logits do not depend on which others share its batch
        assert torch.equal(skinny_linear(x[r:r + 1], w), one[r:r + 1])


def test_no_rows_give_no_rows():
    assert skinny_linear(torch.empty(0, 64), torch.randn(10, 64), torch.randn(10)).shape == (0, 10)


def test_a_strided_input_is_read_as_its_values():
    x = torch.randn(3, 64 * 2)[:, ::2]
    w = torch.randn(10, 64)
    torch.testing.assert_close(skinny_linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("x,w,b,field", [
    (torch.randn(5, 8), torch.randn(3, 8), None, "x"),
    (torch.randn(2, 8), torch.randn(3, 9), None, "weight"),
    (torch.randn(2, 8), torch.randn(8, 3).t(), None, "weight"),
    (torch.randn(2, 8).double(), torch.randn(3, 8).double(), None, "float32"),
    (torch.randn(2, 8), torch.randn(3, 8), torch.randn(4), "bias"),
])
def test_bad_inputs_name_what_is_wrong(x, w, b, field):
    with pytest.raises(RuntimeError, match=field):
        skinny_linear(x, w, b)


def test_packed_linear_takes_it_for_few_rows_only():
    linear = torch.nn.Linear(96, 40)
    packed = PackedLinear.from_linear(linear)
    assert packed.use_skinny_kernel()
    calls = []
    real = torch.ops.pdserve.skinny_linear
    torch.ops.pdserve.skinny_linear = lambda *a: calls.append(a[0].shape[0]) or real(*a)
    try:
        for rows in (1, SKINNY_MAX_ROWS, SKINNY_MAX_ROWS + 1, 64):
            x = torch.randn(rows, 96)
            torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
    finally:
        torch.ops.pdserve.skinny_linear = real
    assert calls == [1, SKINNY_MAX_ROWS]


def test_packed_linear_keeps_onednn_for_a_weight_it_cannot_stream():
    packed = PackedLinear(torch.randn(32, 16).t(), None)  # a transposed view: not contiguous
    assert not packed.use_skinny_kernel()
    x = torch.randn(2, 32)
    torch.testing.assert_close(packed(x), x @ packed.weight.t(), rtol=1e-5, atol=1e-5)


def _fp8(n_out: int, k_len: int, block_columns: int, seed: int) -> Fp8Linear:
    """An Fp8Linear of random e4m3fn bytes (every value, subnormals and -0 among them; no NaN)
    and positive scales of varied size."""
    g = torch.Generator().manual_seed(seed)
    layer = Fp8Linear(k_len, n_out, bias=False, block_columns=block_columns)
    bytes_ = torch.randint(0, 256, (n_out, k_len), generator=g, dtype=torch.uint8)
    bytes_[(bytes_ & 0x7F) == 0x7F] = 0x3C  # e4m3fn's NaN: no weight holds one
    layer.weight.data.copy_(bytes_)
    layer.weight_scale.data.copy_(torch.rand(layer.weight_scale.shape, generator=g) * 0.01 + 1e-4)
    return layer


@pytest.mark.parametrize("rows", range(0, SKINNY_MAX_ROWS + 1))
@pytest.mark.parametrize("k_len,n_out,block_columns", [
    (576, 960, None), (577, 7, None), (15, 33, None),   # one scale a row (per tensor or channel), tails
    (576, 96, 128), (100, 9, 32), (64, 5, 16),          # block-wise, a partial last block
])
def test_fp8_equals_skinny_linear_over_the_dequantized_weight_bit_for_bit(rows, k_len, n_out, block_columns):
    layer = _fp8(n_out, k_len, block_columns, seed=rows + k_len + n_out)
    x = torch.randn(rows, k_len, generator=torch.Generator().manual_seed(rows))
    got = skinny_linear_fp8(x, layer.weight, layer.weight_scale, layer.block_columns)
    assert torch.equal(got, skinny_linear(x, layer.dequantized(torch.float32)))
    bias = torch.randn(n_out)
    assert torch.equal(skinny_linear_fp8(x, layer.weight, layer.weight_scale, layer.block_columns, bias), got + bias)


@pytest.mark.parametrize("k_len,n_out,block_columns", [(576, 960, None), (577, 7, None), (100, 9, 32), (15, 3, None)])
def test_dequantize_fp8_gives_torchs_dequantized_weight_bit_for_bit(k_len, n_out, block_columns):
    layer = _fp8(n_out, k_len, block_columns, seed=k_len + n_out)
    assert torch.equal(dequantize_fp8(layer.weight, layer.weight_scale, layer.block_columns),
                       layer.dequantized(torch.float32))


def test_fp8_layer_takes_the_kernel_for_up_to_8_float32_rows_and_the_dequantizer_for_more():
    layer = _fp8(40, 96, 32, seed=3)
    assert layer.use_skinny_kernel()
    calls = []
    real = torch.ops.pdserve.skinny_linear_fp8, torch.ops.pdserve.dequantize_fp8
    torch.ops.pdserve.skinny_linear_fp8 = lambda *a: calls.append(("rows", a[0].shape[0])) or real[0](*a)
    torch.ops.pdserve.dequantize_fp8 = lambda *a: calls.append("dequantize") or real[1](*a)
    try:
        for rows in (1, 4, 5, 8, 9, 64):  # up to two calls of 4 rows, then the dequantized weight
            x = torch.randn(rows, 96)
            want = F.linear(x, layer.dequantized(torch.float32))
            got = layer(x)
            assert torch.equal(got, want) if rows > 8 else torch.allclose(got, want, rtol=1e-5, atol=1e-5)
            if rows <= 8:  # each row as the kernel gives it alone
                assert torch.equal(got, torch.cat([real[0](x[i:i + 1], layer.weight, layer.weight_scale, 32, None)
                                                   for i in range(rows)]))
        x = torch.randn(1, 96, dtype=torch.bfloat16)
        assert torch.equal(layer(x), F.linear(x, layer.dequantized(torch.bfloat16)))
    finally:
        torch.ops.pdserve.skinny_linear_fp8, torch.ops.pdserve.dequantize_fp8 = real
    assert calls == [("rows", 1), ("rows", 4), ("rows", 4), ("rows", 1), ("rows", 4), ("rows", 4),
                     "dequantize", "dequantize", "dequantize"]
    assert not _fp8(8, 96, 24, seed=4).use_skinny_kernel()  # scale blocks splitting 16-column groups


@pytest.mark.parametrize("x,weight,scale,block_columns,field", [
    (torch.randn(2, 32), torch.zeros(3, 32, dtype=torch.uint8), torch.ones(3, 4), 8, "block_columns"),
    (torch.randn(2, 8), torch.zeros(3, 8, dtype=torch.uint8), torch.ones(3, 2), 16, "scale"),
    (torch.randn(2, 8), torch.zeros(3, 8, dtype=torch.uint8), torch.ones(3, 1, dtype=torch.float64), 16, "scale"),
    (torch.randn(2, 8), torch.zeros(3, 8), torch.ones(3, 1), 16, "weight"),
    (torch.randn(2, 8), torch.zeros(3, 9, dtype=torch.uint8), torch.ones(3, 1), 16, "weight"),
    (torch.randn(5, 8), torch.zeros(3, 8, dtype=torch.uint8), torch.ones(3, 1), 16, "x"),
])
def test_fp8_bad_inputs_name_what_is_wrong(x, weight, scale, block_columns, field):
    with pytest.raises(RuntimeError, match=field):
        skinny_linear_fp8(x, weight, scale, block_columns)
