"""Quantizes a Hugging Face folder to the `fp8` checkpoint format as its writers lay it out
(vLLM's and transformers' `quant_method: fp8`): float8_e4m3fn projection weights with a
float32 `weight_scale` per tensor (a scalar) or per output channel ([out, 1]), or block-wise
with `weight_scale_inv` [ceil(out / rows), ceil(in / columns)] and `weight_block_size`; an
`input_scale` scalar with activation_scheme "static". Beside it, the reference folder: the
same model with the dequantized weights (fp8 x scale) in float32, for transformers to run."""
from __future__ import annotations

import json
import os
import re
import shutil

import torch
from safetensors.torch import load_file, save_file

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
_PROJ = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")


def _blocks(scale: torch.Tensor, shape: torch.Size, block: tuple[int, int]) -> torch.Tensor:
    """A block-wise scale expanded to one value a weight."""
    return scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:shape[0], :shape[1]]


def quantize(w: torch.Tensor, scheme: str, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp8 weight, the scale as the format stores it, the scale expanded to the weight's shape)."""
    w = w.float()
    if scheme == "tensor":
        scale = (w.abs().max() / FP8_MAX).reshape(())
        full = scale.expand_as(w)
    elif scheme == "channel":
        scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
        full = scale.expand_as(w)
    else:
        rows, cols = -(-w.shape[0] // block[0]), -(-w.shape[1] // block[1])
        padded = torch.zeros(rows * block[0], cols * block[1])
        padded[:w.shape[0], :w.shape[1]] = w.abs()
        scale = padded.view(rows, block[0], cols, block[1]).amax(dim=(1, 3)) / FP8_MAX
        full = _blocks(scale, w.shape, block)
    full = full.clamp_min(1e-12)
    return (w / full).to(torch.float8_e4m3fn), scale.clamp_min(1e-12), full


def write_fp8_folders(src: str, fp8_dir: str, reference_dir: str, scheme: str = "tensor",
                      block: tuple[int, int] = (24, 32), activation_scheme: str = "dynamic") -> None:
    """`scheme`: "tensor", "channel" or "block"."""
    tensors = load_file(os.path.join(src, "model.safetensors"))
    quantized, reference = {}, {}
    for name, w in tensors.items():
        if not _PROJ.match(name):
            quantized[name] = reference[name] = w
            continue
        w8, scale, full = quantize(w, scheme, block)
        prefix = name[:-len(".weight")]
        quantized[name] = w8
        quantized[f"{prefix}.weight_scale_inv" if scheme == "block" else f"{prefix}.weight_scale"] = scale
        if activation_scheme == "static":
            quantized[f"{prefix}.input_scale"] = torch.tensor(0.05)
        reference[name] = w8.float() * full
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    quant = {"quant_method": "fp8", "activation_scheme": activation_scheme}
    if scheme == "block":
        quant["weight_block_size"] = list(block)
    for folder, weights, cfg in ((fp8_dir, quantized, {**config, "quantization_config": quant}),
                                 (reference_dir, reference, config)):
        os.makedirs(folder, exist_ok=True)
        for entry in os.listdir(src):  # the tokenizer's files
            if entry not in ("model.safetensors", "config.json"):
                shutil.copy(os.path.join(src, entry), folder)
        save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(folder, "model.safetensors"),
                  metadata={"format": "pt"})
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(cfg, f)


def edit_fp8_folder(folder: str, config_edit=None, tensors_edit=None) -> None:
    """Changes a written fp8 folder in place: its quantization_config, its tensors."""
    if config_edit is not None:
        path = os.path.join(folder, "config.json")
        with open(path) as f:
            config = json.load(f)
        config_edit(config["quantization_config"])
        with open(path, "w") as f:
            json.dump(config, f)
    if tensors_edit is not None:
        path = os.path.join(folder, "model.safetensors")
        tensors = load_file(path)
        tensors_edit(tensors)
        save_file(tensors, path, metadata={"format": "pt"})
