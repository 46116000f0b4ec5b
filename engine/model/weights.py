"""Weight iterators yielding (Hugging Face tensor name, tensor), from safetensors or GGUF."""
from __future__ import annotations

import glob
import os
import re
from collections.abc import Callable, Collection, Iterator

import numpy as np
import torch
from tqdm.auto import tqdm

from pdserve.engine.errors import ModelLoadError
from pdserve.engine.model.gguf_file import GGUFFile

_GGUF_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_TO_HF = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_GGUF_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def safetensors_files(folder: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ModelLoadError(folder, "no *.safetensors files in the model folder")
    return files


def safetensors_names(folder: str) -> set[str]:
    """The names of every tensor in the folder's files, from their headers alone."""
    from safetensors import safe_open
    names: set[str] = set()
    for path in safetensors_files(folder):
        try:
            with safe_open(path, framework="pt") as handle:
                names.update(handle.keys())
        except Exception as e:  # safetensors raises its own error type for corrupt headers
            raise ModelLoadError(path, f"cannot read safetensors file ({e})") from None
    return names


def iter_safetensors(folder: str, progress: bool = True,
                     wanted: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor (by HF name), or those `wanted` accepts, unread otherwise."""
    from safetensors import safe_open
    files = safetensors_files(folder)
    handles = []
    for path in files:
        try:
            handles.append((path, safe_open(path, framework="pt")))
        except Exception as e:  # safetensors raises its own error type for corrupt headers
            raise ModelLoadError(path, f"cannot read safetensors file ({e})") from None
    total = sum(len(h.keys()) for _, h in handles)
    with tqdm(total=total, desc="Loading weights", unit="tensor", disable=not progress) as bar:
        for path, handle in handles:
            for name in handle.keys():
                if wanted is not None and not wanted(name):
                    bar.update(1)
                    continue
                try:
                    tensor = handle.get_tensor(name)
                except Exception as e:
                    raise ModelLoadError(path, f"cannot read tensor {name} ({e})") from None
                yield name, tensor
                bar.update(1)


def open_gguf(path: str) -> GGUFFile:
    try:
        return GGUFFile(path)
    except (OSError, ValueError) as e:  # GGUFFormatError is a ValueError; an empty file fails mmap
        raise ModelLoadError(path, f"cannot read GGUF file ({e})") from None


def gguf_metadata(reader: GGUFFile) -> dict:
    """The metadata without the tokenizer's big arrays (the tokenizer loader reads those itself)."""
    return {name: value for name, value in reader.metadata.items()
            if not name.startswith("tokenizer.ggml.") or name == "tokenizer.ggml.eos_token_id"}


def iter_gguf(reader: GGUFFile, path: str, num_heads: int, num_kv_heads: int, permuted_qk: bool,
              progress: bool = True, wanted: Callable[[str], bool] | None = None,
              kept: Collection[str] = ()) -> Iterator[tuple[str, torch.Tensor]]:
    """Dequantize every tensor (or those whose HF name `wanted` accepts) to float32 and
    undo llama.cpp's Q/K row permutation. Tensors named in `kept` come as their GGUF blocks
    instead, uint8 [rows, bytes a row] (engine/model/gguf_linear.py), their rows reordered alike."""
    from gguf.quants import dequantize
    for tensor in tqdm(reader.tensors, desc="Loading weights", unit="tensor", disable=not progress):
        if tensor.name == "rope_freqs.weight":
            yield "rope_freqs", torch.from_numpy(np.asarray(tensor.data, dtype=np.float32).copy())
            continue
        name = _hf_name(tensor.name, path)
        if wanted is not None and not wanted(name):
            continue
        if name in kept:
            weight = torch.from_numpy(np.array(tensor.data, dtype=np.uint8))  # a copy of the mmap's blocks
        else:
            try:
                data = dequantize(tensor.data, tensor.tensor_type)
            except Exception as e:
                raise ModelLoadError(path, f"cannot dequantize tensor {tensor.name} ({e})") from None
            weight = torch.from_numpy(np.array(data, dtype=np.float32))  # a copy: GGUF data is a read-only mmap
        if permuted_qk and name.endswith(("q_proj.weight", "q_proj.bias")):
            weight = _unpermute(weight, num_heads)
        elif permuted_qk and name.endswith(("k_proj.weight", "k_proj.bias")):
            weight = _unpermute(weight, num_kv_heads)
        yield name, weight


def gguf_tensor_types(reader: GGUFFile, path: str) -> dict[str, int]:
    """Each tensor's ggml type id, by its Hugging Face name."""
    return {_hf_name(t.name, path): int(t.tensor_type) for t in reader.tensors if t.name != "rope_freqs.weight"}


def _hf_name(gguf_name: str, path: str) -> str:
    if gguf_name in _GGUF_TO_HF:
        return _GGUF_TO_HF[gguf_name]
    m = _GGUF_LAYER_RE.match(gguf_name)
    if m is None or m.group(2) not in _GGUF_LAYER_TO_HF:
        raise ModelLoadError(path, f"unexpected GGUF tensor {gguf_name}")
    return f"model.layers.{m.group(1)}.{_GGUF_LAYER_TO_HF[m.group(2)]}.{m.group(3)}"


def _unpermute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp stores each head's rotary halves interleaved; restore the HF half-split rows."""
    shape = w.shape
    return w.reshape(num_heads, shape[0] // num_heads // 2, 2, *shape[1:]).transpose(1, 2).reshape(shape)
