"""Builds the engine's model and tokenizer from a resolved ModelSource."""
from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from engine.config import ModelArchConfig
from engine.dtypes import DTYPE_NAMES, torch_dtype
from engine.errors import ModelLoadError
from engine.model import weights as W
from engine.model.arch import GGUF_ARCHITECTURES, arch_from_gguf_metadata, arch_from_hf_config
from engine.model.llama import LlamaForCausalLM, TensorParallel
from engine.model.shard import ModelShard
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
               progress: bool = True, shard: Callable[[ModelArchConfig], ModelShard] | None = None,
               tp: TensorParallel | None = None) -> LoadedModel:
    """`max_model_len` bounds the RoPE tables; None means the model's own context.
    `shard`: which part of the model this rank holds, given the model's shape (every
    tensor is narrowed to it as it is read); None: the whole model."""
    if source.kind == "gguf":
        reader = W.open_gguf(source.path)
        meta = W.gguf_metadata(reader)
        arch = arch_from_gguf_metadata(meta, {t.name for t in reader.tensors}, source.path)
        model_shard = shard(arch) if shard is not None else ModelShard.whole(arch)
        permuted = GGUF_ARCHITECTURES[meta["general.architecture"]][1]
        weights = W.iter_gguf(reader, source.path, arch.num_heads, arch.num_kv_heads, permuted, progress,
                              _stage_filter(model_shard))
        eos = {int(meta["tokenizer.ggml.eos_token_id"])} if "tokenizer.ggml.eos_token_id" in meta else set()
    else:
        hf_config = _read_json(os.path.join(source.path, "config.json"))
        arch = arch_from_hf_config(hf_config, source.path)
        model_shard = shard(arch) if shard is not None else ModelShard.whole(arch)
        weights = W.iter_safetensors(source.path, progress, _stage_filter(model_shard))
        eos = _hf_eos_ids(source.path, hf_config)
    tokenizer = load_tokenizer(source)
    if not eos and tokenizer.eos_token_id is not None:
        eos = {tokenizer.eos_token_id}
    if max_model_len is not None and max_model_len > arch.max_position_embeddings:
        raise ValueError(f"max_model_len: {max_model_len} exceeds the model's context of "
                         f"{arch.max_position_embeddings} tokens")
    model = _build(arch, dtype, device, max_model_len or arch.max_position_embeddings, weights, source.path,
                   model_shard, tp)
    return LoadedModel(model, arch, tokenizer, frozenset(eos))


def read_arch(source: ModelSource) -> ModelArchConfig:
    """The model's shape alone, without reading any weight."""
    if source.kind == "gguf":
        reader = W.open_gguf(source.path)
        return arch_from_gguf_metadata(W.gguf_metadata(reader), {t.name for t in reader.tensors}, source.path)
    return arch_from_hf_config(_read_json(os.path.join(source.path, "config.json")), source.path)


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
           weights: Iterable[tuple[str, torch.Tensor]], path: str, shard: ModelShard,
           tp: TensorParallel | None) -> LlamaForCausalLM:
    with torch.device("meta"):
        model = LlamaForCausalLM(arch, max_positions, shard, tp)
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
        for param_name, shard in _targets(model, name):
            _copy_into(model, params, param_name, shard, _rank_part(model, name, tensor), name, path, filled)
    missing = [p for p in params if not _all_shards_filled(model, p, filled)]
    if missing:
        raise ModelLoadError(path, f"weights missing for {missing[:5]}{' ...' if len(missing) > 5 else ''}")


def _copy_into(model: LlamaForCausalLM, params: dict, param_name: str, shard: int, tensor: torch.Tensor,
               name: str, path: str, filled: set[tuple[str, int]]) -> None:
    dest = _shard_view(model, params[param_name], param_name, shard)
    if tuple(dest.shape) != tuple(tensor.shape):
        raise ModelLoadError(path, f"tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
    with torch.no_grad():
        dest.copy_(tensor)
    filled.add((param_name, shard))


_FUSED = {  # HF sub-name -> (our sub-name, shard index)
    "self_attn.q_proj": ("attn.qkv_proj", 0), "self_attn.k_proj": ("attn.qkv_proj", 1),
    "self_attn.v_proj": ("attn.qkv_proj", 2), "self_attn.o_proj": ("attn.o_proj", 0),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0), "mlp.up_proj": ("mlp.gate_up_proj", 1),
    "mlp.down_proj": ("mlp.down_proj", 0), "input_layernorm": ("input_norm", 0),
    "post_attention_layernorm": ("post_attn_norm", 0),
}


def _targets(model: LlamaForCausalLM, name: str) -> list[tuple[str, int]]:
    """Our parameters (name, fused shard) an HF tensor fills: none for tensors we do not use
    or another pipeline stage holds; two for a tied embedding a split model keeps twice."""
    shard = model.shard
    if name == "model.embed_tokens.weight":
        targets = [("embed_tokens.weight", 0)] if model.embed_tokens is not None else []
        if model.cfg.tie_word_embeddings and model.lm_head is not None:
            targets.append(("lm_head.weight", 0))
        return targets
    if name == "model.norm.weight":
        return [("norm.weight", 0)] if model.norm is not None else []
    if name == "lm_head.weight":
        return [] if model.lm_head is None or model.cfg.tie_word_embeddings else [("lm_head.weight", 0)]
    m = _LAYER_RE.match(name)
    if m is None or int(m.group(1)) not in shard.layers:
        return []
    module, _, kind = m.group(2).rpartition(".")
    if module not in _FUSED:
        return []  # e.g. rotary_emb.inv_freq buffers of old checkpoints
    ours, fused = _FUSED[module]
    return [(f"layers.{int(m.group(1)) - shard.layers.start}.{ours}.{kind}", fused)]


def _stage_filter(shard: ModelShard) -> Callable[[str], bool] | None:
    """For a part of the model, the tensors it reads (other stages' layers are skipped unread)."""
    return None if shard.is_whole else (lambda name: _stage_wants(shard, name))


def _stage_wants(shard: ModelShard, name: str) -> bool:
    """Whether a pipeline stage reads a tensor at all."""
    m = _LAYER_RE.match(name)
    if m is not None:
        return int(m.group(1)) in shard.layers
    if name == "model.embed_tokens.weight":
        return True  # the first stage embeds; the last one's LM head may be tied to it
    if name in ("model.norm.weight", "lm_head.weight"):
        return shard.is_last_stage
    return True


# HF module -> the dimension tensor parallelism splits it along, and by what (shard field)
_SPLIT = {"self_attn.q_proj": (0, "q_heads"), "self_attn.k_proj": (0, "kv_heads"),
          "self_attn.v_proj": (0, "kv_heads"), "self_attn.o_proj": (1, "q_heads"),
          "mlp.gate_proj": (0, "intermediate"), "mlp.up_proj": (0, "intermediate"),
          "mlp.down_proj": (1, "intermediate")}


def _rank_part(model: LlamaForCausalLM, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of an HF tensor (itself when nothing is split)."""
    shard = model.shard
    if shard.tp_size == 1:
        return tensor
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        part = tensor[shard.vocab.start:shard.vocab.stop]
        pad = shard.vocab_shard_size - part.shape[0]
        return torch.cat([part, part.new_zeros(pad, *part.shape[1:])]) if pad else part
    m = _LAYER_RE.match(name)
    if m is None:
        return tensor
    module, _, kind = m.group(2).rpartition(".")
    if module not in _SPLIT or (kind == "bias" and _SPLIT[module][0] == 1):
        return tensor  # norms; a row-parallel bias is added once, after the sum
    dim, field = _SPLIT[module]
    units = getattr(shard, field)  # heads (head_dim rows each) or MLP columns
    width = 1 if field == "intermediate" else model.cfg.head_dim
    return tensor.narrow(dim, units.start * width, len(units) * width)


def _shard_sizes(model: LlamaForCausalLM, param_name: str) -> list[int]:
    """The fused parts of a parameter, as this rank holds them."""
    cfg, shard = model.cfg, model.shard
    if ".qkv_proj." in param_name:
        kv = len(shard.kv_heads) * cfg.head_dim
        return [len(shard.q_heads) * cfg.head_dim, kv, kv]
    if ".gate_up_proj." in param_name:
        return [len(shard.intermediate)] * 2
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
