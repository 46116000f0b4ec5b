"""Builds the engine's model and tokenizer from a resolved ModelSource."""
from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from engine.config import ModelArchConfig
from engine.dtypes import DTYPE_NAMES, torch_dtype
from engine.errors import ModelLoadError
from engine.model import weights as W
from engine.model.arch import GGUF_ARCHITECTURES, arch_from_gguf_metadata, arch_from_hf_config
from engine.model.llama import LlamaForCausalLM
from engine.model.source import ModelSource

_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)$")


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    arch: ModelArchConfig
    tokenizer: object
    eos_token_ids: frozenset[int]


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in map(torch_dtype, DTYPE_NAMES):
        return dtype
    if dtype in ("auto", None):
        return torch.float32
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype: must be one of {sorted(DTYPE_NAMES)}, got {dtype!r}")
    return torch_dtype(dtype)


def load_model(source: ModelSource, dtype: torch.dtype, device: str, max_model_len: int | None = None,
               progress: bool = True) -> LoadedModel:
    """`max_model_len` bounds the RoPE tables; None means the model's own context."""
    if source.kind == "gguf":
        reader = W.open_gguf(source.path)
        meta = W.gguf_metadata(reader)
        arch = arch_from_gguf_metadata(meta, {t.name for t in reader.tensors}, source.path)
        permuted = GGUF_ARCHITECTURES[meta["general.architecture"]][1]
        weights = W.iter_gguf(reader, source.path, arch.num_heads, arch.num_kv_heads, permuted, progress)
        eos = {int(meta["tokenizer.ggml.eos_token_id"])} if "tokenizer.ggml.eos_token_id" in meta else set()
    else:
        hf_config = _read_json(os.path.join(source.path, "config.json"))
        arch = arch_from_hf_config(hf_config, source.path)
        weights = W.iter_safetensors(source.path, progress)
        eos = _hf_eos_ids(source.path, hf_config)
    tokenizer = load_tokenizer(source)
    if not eos and tokenizer.eos_token_id is not None:
        eos = {tokenizer.eos_token_id}
    if max_model_len is not None and max_model_len > arch.max_position_embeddings:
        raise ValueError(f"max_model_len: {max_model_len} exceeds the model's context of "
                         f"{arch.max_position_embeddings} tokens")
    model = _build(arch, dtype, device, max_model_len or arch.max_position_embeddings, weights, source.path)
    return LoadedModel(model, arch, tokenizer, frozenset(eos))


def load_tokenizer(source: ModelSource):
    from transformers import AutoTokenizer
    try:
        if source.kind == "gguf":
            return AutoTokenizer.from_pretrained(os.path.dirname(source.path),
                                                 gguf_file=os.path.basename(source.path))
        return AutoTokenizer.from_pretrained(source.path)
    except Exception as e:
        raise ModelLoadError(source.path, f"cannot load the tokenizer ({e})") from None


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(path, f"cannot read JSON ({e})") from None


def _hf_eos_ids(folder: str, hf_config: dict) -> set[int]:
    gen_path = os.path.join(folder, "generation_config.json")
    source = _read_json(gen_path) if os.path.isfile(gen_path) else hf_config
    eos = source.get("eos_token_id", hf_config.get("eos_token_id"))
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, list) else {eos}


def _build(arch: ModelArchConfig, dtype: torch.dtype, device: str, max_positions: int,
           weights: Iterable[tuple[str, torch.Tensor]], path: str) -> LlamaForCausalLM:
    with torch.device("meta"):
        model = LlamaForCausalLM(arch, max_positions)
    model.to_empty(device=device)
    model.to(dtype)
    _load_weights(model, weights, path)
    model.rope.to_device(torch.device(device), dtype)
    return model.eval()


def _load_weights(model: LlamaForCausalLM, weights: Iterable[tuple[str, torch.Tensor]], path: str) -> None:
    params = dict(model.named_parameters())
    filled: set[tuple[str, int]] = set()
    for name, tensor in weights:
        if name == "rope_freqs":
            model.rope.apply_freq_factors(tensor)
            continue
        target = _target(model, name)
        if target is None:
            continue
        param_name, shard = target
        dest = _shard_view(model, params[param_name], param_name, shard)
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ModelLoadError(path, f"tensor {name} has shape {tuple(tensor.shape)}, "
                                       f"expected {tuple(dest.shape)}")
        with torch.no_grad():
            dest.copy_(tensor)
        filled.add((param_name, shard))
    missing = [p for p in params if not _all_shards_filled(model, p, filled)]
    if missing:
        raise ModelLoadError(path, f"weights missing for {missing[:5]}{' ...' if len(missing) > 5 else ''}")


_FUSED = {  # HF sub-name -> (our sub-name, shard index)
    "self_attn.q_proj": ("attn.qkv_proj", 0), "self_attn.k_proj": ("attn.qkv_proj", 1),
    "self_attn.v_proj": ("attn.qkv_proj", 2), "self_attn.o_proj": ("attn.o_proj", 0),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0), "mlp.up_proj": ("mlp.gate_up_proj", 1),
    "mlp.down_proj": ("mlp.down_proj", 0), "input_layernorm": ("input_norm", 0),
    "post_attention_layernorm": ("post_attn_norm", 0),
}


def _target(model: LlamaForCausalLM, name: str) -> tuple[str, int] | None:
    """Our parameter name and shard for an HF tensor name; None for tensors we do not use."""
    if name == "model.embed_tokens.weight":
        return "embed_tokens.weight", 0
    if name == "model.norm.weight":
        return "norm.weight", 0
    if name == "lm_head.weight":
        return None if model.lm_head is None else ("lm_head.weight", 0)
    m = _LAYER_RE.match(name)
    if m is None:
        return None
    module, _, kind = m.group(2).rpartition(".")
    if module not in _FUSED:
        return None  # e.g. rotary_emb.inv_freq buffers of old checkpoints
    ours, shard = _FUSED[module]
    return f"layers.{m.group(1)}.{ours}.{kind}", shard


def _shard_sizes(model: LlamaForCausalLM, param_name: str) -> list[int]:
    cfg = model.cfg
    if ".qkv_proj." in param_name:
        return [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim]
    if ".gate_up_proj." in param_name:
        return [cfg.intermediate_size, cfg.intermediate_size]
    return []


def _shard_view(model: LlamaForCausalLM, param: torch.Tensor, param_name: str, shard: int) -> torch.Tensor:
    sizes = _shard_sizes(model, param_name)
    if not sizes:
        return param.data
    start = sum(sizes[:shard])
    return param.data.narrow(0, start, sizes[shard])


def _all_shards_filled(model: LlamaForCausalLM, param_name: str, filled: set[tuple[str, int]]) -> bool:
    num = len(_shard_sizes(model, param_name)) or 1
    return all((param_name, s) in filled for s in range(num))
