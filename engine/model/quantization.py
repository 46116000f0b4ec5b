"""Quantized checkpoints: the format a checkpoint's `quantization_config` names, checked
before any weight is read, and which of the model's linear layers keep quantized weights.

Supported so far: `fp8`, as vLLM and transformers write it: float8_e4m3fn weights with a
float32 `weight_scale` per tensor or per output channel, or block-wise with
`weight_block_size` [rows, columns] and a `weight_scale_inv` per block (DeepSeek-V3's and the
Qwen3 FP8 releases' layout; both names multiply, as their reference dequantizers do). The
weights stay fp8 in memory (fp8_linear.py); the layers compute weight-only (W8A16), so an
`input_scale` (activation_scheme "static") is read and not applied, as vLLM's fp8 path does
on a device without fp8 matrix units. Every other method or scheme is refused here, the
error naming the `quantization_config` field and the values supported.

A layer is quantized when its checkpoint tensors carry a scale (what vLLM's
`ignored_layers` and transformers' `modules_to_not_convert` exclude carries none), so the
decision reads the tensor names, never a guess from the config alone.
"""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.errors import ModelLoadError

SUPPORTED_METHODS = ("fp8",)
ACTIVATION_SCHEMES = ("dynamic", "static")
# checkpoint tensors beside a quantized weight that the engine reads no value from: the
# activations' scale (weight-only compute) and the KV cache's (an fp8 KV cache is not served)
UNUSED_SCALES = ("input_scale", "k_scale", "v_scale", "kv_scale", "activation_scale")
# per tensor or per channel: `weight_scale`; block-wise: `weight_scale_inv`
SCALE_NAMES = ("weight_scale", "weight_scale_inv")
# the HF modules whose weights a layer of ours fuses, which must be quantized alike
FUSED_MODULES = {"self_attn.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                 "mlp.gate_up": ("mlp.gate_proj", "mlp.up_proj")}
LAYER_MODULES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@dataclass(frozen=True)
class QuantConfig:
    method: str                                  # "fp8"
    activation_scheme: str = "dynamic"
    weight_block_size: tuple[int, int] | None = None  # (rows, columns) of a block-wise scale; None: per tensor/channel

    def describe(self) -> str:
        scale = (f"block-wise scales ({self.weight_block_size[0]}x{self.weight_block_size[1]})"
                 if self.weight_block_size else "per-tensor/per-channel scales")
        unused = ", activation scales not applied" if self.activation_scheme == "static" else ""
        return f"{self.method} weights with {scale}, computed weight-only (W8A16){unused}"


def read_quant_config(hf_config: dict, path: str) -> QuantConfig | None:
    """The checkpoint's quantization, checked; None for a full-precision checkpoint."""
    qc = hf_config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ModelLoadError(path, f"quantization_config: must be an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method not in SUPPORTED_METHODS:
        raise ModelLoadError(path, f"quantization_config.quant_method: {method!r} is not supported; supported: "
                                   f"{', '.join(SUPPORTED_METHODS)} (gptq, awq, compressed-tensors, bitsandbytes "
                                   "and the others are not served yet)")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme not in ACTIVATION_SCHEMES:
        raise ModelLoadError(path, f"quantization_config.activation_scheme: {scheme!r} is not one of "
                                   f"{', '.join(ACTIVATION_SCHEMES)}")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ModelLoadError(path, f"quantization_config.fmt: {fmt!r} is not supported; supported: e4m3 "
                                   "(float8_e4m3fn weights)")
    block = qc.get("weight_block_size")
    if block is not None:
        if not (isinstance(block, list | tuple) and len(block) == 2
                and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise ModelLoadError(path, f"quantization_config.weight_block_size: must be two positive integers "
                                       f"[rows, columns], got {block!r}")
        block = (int(block[0]), int(block[1]))
    return QuantConfig(method, scheme, block)


def quantized_modules(tensor_names: set[str], num_layers: int, path: str) -> set[tuple[int, str]]:
    """(layer, fused module) pairs whose weights are fp8 in the checkpoint ("self_attn.qkv",
    "self_attn.o_proj", "mlp.gate_up", "mlp.down_proj"); refuses a fused layer whose parts
    differ, and quantized tensors the engine has no quantized layer for."""
    def has_scale(layer: int, module: str) -> bool:
        return any(f"model.layers.{layer}.{module}.{s}" in tensor_names for s in SCALE_NAMES)

    out: set[tuple[int, str]] = set()
    for layer in range(num_layers):
        for fused, parts in FUSED_MODULES.items():
            flags = [has_scale(layer, p) for p in parts]
            if any(flags) and not all(flags):
                raise ModelLoadError(path, f"layer {layer}: {', '.join(parts)} are fused into one layer and must be "
                                           f"quantized alike; the checkpoint has scales for "
                                           f"{[p for p, f in zip(parts, flags) if f]} only")
            if all(flags):
                out.add((layer, fused))
        for module in ("self_attn.o_proj", "mlp.down_proj"):
            if has_scale(layer, module):
                out.add((layer, module))
    known = {f"model.layers.{layer}.{m}.{s}" for layer in range(num_layers) for m in LAYER_MODULES
             for s in SCALE_NAMES}
    other = sorted(n for n in tensor_names if n.rsplit(".", 1)[-1] in SCALE_NAMES and n not in known)
    if other:
        raise ModelLoadError(path, f"quantized tensors outside the attention and MLP projections are not served yet "
                                   f"(the LM head, MoE experts, fused checkpoints): {other[:3]}")
    return out
