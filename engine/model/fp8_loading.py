"""Loading an fp8 checkpoint (quantization.py's config): its quantized projections as
Fp8Linear on the meta model, and each rank's part of a weight's scale."""
from __future__ import annotations

import torch

from pdserve.engine.errors import ModelLoadError
from pdserve.engine.model.decoder import DecoderForCausalLM
from pdserve.engine.model.fp8_linear import fp8_linear_like
from pdserve.engine.model.quantization import QuantConfig


# a quantized module of quantization.quantized_modules -> the layer of ours that computes it
_QUANTIZED_LAYERS = {"self_attn.qkv": ("attn", "qkv_proj"), "self_attn.o_proj": ("attn", "o_proj"),
                     "mlp.gate_up": ("mlp", "gate_up_proj"), "mlp.down_proj": ("mlp", "down_proj")}


def use_fp8_linears(model: DecoderForCausalLM, quant: QuantConfig | None, quantized: set[tuple[int, str]]) -> None:
    """This stage's quantized projections as Fp8Linear, on the meta device (nothing allocated yet)."""
    if quant is None:
        return
    block_columns = quant.weight_block_size[1] if quant.weight_block_size else None
    for layer, module in quantized:
        if layer not in model.shard.layers:
            continue
        parent = getattr(model.layers[layer - model.shard.layers.start], _QUANTIZED_LAYERS[module][0])
        name = _QUANTIZED_LAYERS[module][1]
        setattr(parent, name, fp8_linear_like(getattr(parent, name), block_columns))


def scale_part(model: DecoderForCausalLM, name: str, tensor: torch.Tensor,
                split: tuple[int, str] | None) -> torch.Tensor:
    """This rank's part of an fp8 weight's scale, as Fp8Linear holds it: [rows, column
    blocks] float32, one row a weight row (a per-tensor scale stays [1, 1] until it meets
    its rows). A row-parallel layer splits its columns, so a block-wise scale's column blocks
    are split with them, which needs the split on a block boundary."""
    if tensor.numel() == 1:
        return tensor.reshape(1, 1).float()
    quant, shard = model.quant_config, model.shard
    if name.endswith("_inv"):
        if quant is None or quant.weight_block_size is None:
            raise ModelLoadError(name, "a block-wise scale (weight_scale_inv) needs "
                                       "quantization_config.weight_block_size")
        block_rows, block_columns = quant.weight_block_size
        tensor = tensor.float().repeat_interleave(block_rows, dim=0)
    else:
        tensor, block_columns = tensor.float().reshape(-1, 1), None
    if shard.tp_size == 1 or split is None:
        return tensor
    dim, field = split
    units = getattr(shard, field)
    width = model.cfg.head_dim if field.endswith("heads") else 1
    start, length = units.start * width, len(units) * width
    if dim == 0:
        return tensor.narrow(0, start, length)
    if block_columns is None:
        return tensor  # per channel: each rank's rows are all the output rows
    if start % block_columns or length % block_columns:
        raise ModelLoadError(name, f"quantization_config.weight_block_size: columns {start}-{start + length} of this "
                                   f"rank's part do not fall on the {block_columns}-column blocks; choose a "
                                   f"tensor-parallel size that splits on them")
    return tensor.narrow(1, start // block_columns, length // block_columns)
