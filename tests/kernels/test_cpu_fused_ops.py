"""The C++ norm and RoPE ops (kernels/cpu/fused_ops.cpp) against the decoder's torch modules
they replace on CPU: RoPE and every 16-bit result bit for bit (the same roundings, op by op),
float32 norms within a few ulps (only the sum of squares' order differs)."""
from __future__ import annotations

import pytest
import torch

from pdserve.engine.model.decoder import RMSNorm
from pdserve.engine.model.rope import RotaryEmbedding
from pdserve.kernels.cpu import fused_add_rms_norm, rms_norm, rotary_embedding

HIDDEN = 576  # SmolLM2's: 36 lanes of 16


def make_norm(dtype: torch.dtype, offset: bool, size: int = HIDDEN) -> RMSNorm:
    norm = RMSNorm(size, 1e-5, offset=offset)
    norm.weight.data = torch.randn(size)
    return norm.to(dtype)


def assert_norms_agree(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.dtype == ref.dtype and ours.shape == ref.shape
    if ref.dtype == torch.float32:
        torch.testing.assert_close(ours, ref, atol=0, rtol=4 * torch.finfo(torch.float32).eps)
    else:
        # one rounding of the norm's scale apart at most: a value may land one bf16 step away
        steps = (ours.float() - ref.float()).abs() / ref.float().abs().clamp(min=1e-30)
        assert (ours == ref).float().mean() > 0.99 and steps.max() <= 2 * torch.finfo(ref.dtype).eps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset", [False, True])
@pytest.mark.parametrize("rows", [1, 17, 300])  # one thread; split across threads
@pytest.mark.parametrize("size", [HIDDEN, 100])  # a partial last lane group too
def test_rms_norm_matches_module(dtype, offset, rows, size):
    torch.manual_seed(rows)
    norm = make_norm(dtype, offset, size)
    x = (3 * torch.randn(rows, size)).to(dtype)
    assert_norms_agree(rms_norm(x, norm.weight, norm.eps, offset), norm(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 33])
def test_fused_add_rms_norm_rounds_the_sum_as_torch_and_leaves_inputs(dtype, rows):
    torch.manual_seed(0)
    norm = make_norm(dtype, offset=False)
    x, h = torch.randn(rows, HIDDEN).to(dtype), torch.randn(rows, HIDDEN).to(dtype)
    x_before, h_before = x.clone(), h.clone()
    normed, total = fused_add_rms_norm(x, h, norm.weight, norm.eps, False)
    assert torch.equal(total, x + h)  # the residual stream, bit for bit
    assert_norms_agree(normed, norm(x + h))
    assert torch.equal(x, x_before) and torch.equal(h, h_before)  # a layer's input may still be read


def test_rows_of_a_wider_tensor_are_read_through_their_stride():
    norm = make_norm(torch.float32, offset=False)
    wide = torch.randn(5, 2 * HIDDEN)
    view = wide[:, :HIDDEN]
    assert_norms_agree(rms_norm(view, norm.weight, norm.eps, False), norm(view.contiguous()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("partial", [1.0, 0.5])  # Phi-3 style: only the first half of each head rotates
@pytest.mark.parametrize("tokens", [1, 40])
def test_rotary_embedding_is_the_module_bit_for_bit(dtype, partial, tokens):
    torch.manual_seed(tokens)
    rope = RotaryEmbedding(64, 10000.0, None, 4096, partial_rotary_factor=partial)
    rope.to_device(torch.device("cpu"), dtype)
    qkv = torch.randn(tokens, 9 * 64 + 2 * 3 * 64).to(dtype)  # q and k are views into it, as in Attention
    q, k, v = qkv.split([9 * 64, 3 * 64, 3 * 64], dim=-1)
    q, k = q.view(tokens, 9, 64), k.view(tokens, 3, 64)
    positions = torch.randint(0, 4096, (tokens,))
    want_q, want_k = rope(positions, q, k)  # not fused: new tensors
    v_before = v.clone()
    rotary_embedding(q, k, positions, rope.cos_table, rope.sin_table)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(v, v_before)


def test_rotary_embedding_refuses_a_position_outside_its_tables():
    rope = RotaryEmbedding(64, 10000.0, None, 128)
    q, k = torch.randn(2, 4, 64), torch.randn(2, 2, 64)
    with pytest.raises(RuntimeError, match="positions: 128 is outside"):
        rotary_embedding(q, k, torch.tensor([3, 128]), rope.cos_table, rope.sin_table)


def test_mixed_dtypes_are_refused_naming_them():
    norm = make_norm(torch.float32, offset=False)
    with pytest.raises(RuntimeError, match="share one dtype"):
        rms_norm(torch.randn(2, HIDDEN).bfloat16(), norm.weight, norm.eps, False)


def test_a_module_falls_back_to_torch_for_what_the_op_does_not_take():
    """A 3-D input (Qwen3's per-head q/k norm) takes the torch path even when fused."""
    norm = make_norm(torch.float32, offset=False, size=64)
    heads = torch.randn(3, 4, 64)
    want = norm(heads)
    norm.fused = True
    assert torch.equal(norm(heads), want)
