"""kernels/cpu/skinny_linear.cpp: F.linear for 1-4 rows of float32, streaming the plain weight."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine.model.packed_linear import PackedLinear
from pdserve.kernels.cpu import SKINNY_MAX_ROWS, skinny_linear


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
