"""Builds the engine's model and tokenizer from a resolved ModelSource."""
from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from pdserve.engine.config import QUANTIZATION_METHODS, ModelArchConfig
from pdserve.engine.dtypes import DTYPE_NAMES, torch_dtype
from pdserve.engine.errors import ModelLoadError
from pdserve.engine.model import weights as W
from pdserve.engine.model.arch import arch_from_gguf_metadata, arch_from_hf_config
from pdserve.engine.model.arch_table import ARCHITECTURE_FEATURES
from pdserve.engine.model.decoder import DecoderForCausalLM, TensorParallel
from pdserve.engine.model.fp8_linear import Fp8Linear
from pdserve.engine.model.fp8_loading import scale_part, use_fp8_linears
from pdserve.engine.model.gguf_linear import TYPE_NAMES, narrow_gguf_columns
from pdserve.engine.model.gguf_loading import finish_gguf_modules, kept_gguf_tensors, use_gguf_modules
from pdserve.engine.model.quantization import (SCALE_NAMES, UNUSED_SCALES, QuantConfig, quantized_modules,
                                               read_quant_config)
from pdserve.engine.model.shard import ModelShard
from pdserve.engine.model.source import ModelSource
from pdserve.engine.model.tokenizer_cache import load_gguf_tokenizer

logger = logging.getLogger(__name__)
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)$")


@dataclass
class LoadedModel:
    model: DecoderForCausalLM
    arch: ModelArchConfig
    tokenizer: object
    eos_token_ids: frozenset[int]
    quantization: QuantConfig | None = None  # the checkpoint's (None: full precision)


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
               tp: TensorParallel | None = None, quantization: str | None = None) -> LoadedModel:
    """`max_model_len` bounds the RoPE tables; None means the model's own context.
    `shard`: which part of the model this rank holds, given the model's shape (every
    tensor is narrowed to it as it is read); None: the whole model.
    `quantization`: None takes the checkpoint as it is (a GGUF file's weights dequantized,
    an fp8 checkpoint kept fp8); "gguf" keeps a GGUF file's Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q6_K weights in their
    blocks; "fp8" asks for an fp8 checkpoint (refused for any other)."""
    check_quantization(source, quantization)
    quant, quantized, kept = None, set(), {}
    if source.kind == "gguf":
        reader = W.open_gguf(source.path)
        meta = W.gguf_metadata(reader)
        arch = arch_from_gguf_metadata(meta, {t.name for t in reader.tensors}, source.path)
        if quantization == "gguf":
            kept = kept_gguf_tensors(W.gguf_tensor_types(reader, source.path), arch.num_layers)
            file_weights = sum(t.data.nbytes for t in reader.tensors)
        model_shard = shard(arch) if shard is not None else ModelShard.whole(arch)
        permuted = ARCHITECTURE_FEATURES[arch.architecture].gguf_qk_permuted
        weights = W.iter_gguf(reader, source.path, arch.num_heads, arch.num_kv_heads, permuted, progress,
                              _stage_filter(model_shard), kept)
        eos = {int(meta["tokenizer.ggml.eos_token_id"])} if "tokenizer.ggml.eos_token_id" in meta else set()
    else:
        hf_config = _read_json(os.path.join(source.path, "config.json"))
        arch = arch_from_hf_config(hf_config, source.path)
        quant = read_quant_config(hf_config, source.path)
        if quantization is not None and quant is None:
            raise ModelLoadError(source.path, f"quantization: {quantization!r} needs a checkpoint saved in it "
                                              "(config.json's quantization_config); quantizing a full-precision "
                                              "checkpoint at load is not supported yet: leave quantization unset")
        if quant is not None:
            quantized = quantized_modules(W.safetensors_names(source.path), arch.num_layers, source.path)
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
                   model_shard, tp, quant, quantized, kept)
    if quant is not None:
        logger.info("%s: %s in %d of %d layers' projections; weights take %.1f MiB in memory", source.path,
                    quant.describe(), len(quantized), 4 * arch.num_layers, weight_bytes(model) / 2**20)
    elif quantization == "gguf":
        logger.info("%s: %d weights kept in their GGUF blocks (%s), the others in %s; weights take %.1f MiB in "
                    "memory (the file's: %.1f MiB)", source.path, len(kept),
                    ", ".join(sorted({TYPE_NAMES[t] for t in kept.values()})) or "none", dtype,
                    weight_bytes(model) / 2**20, file_weights / 2**20)
    return LoadedModel(model, arch, tokenizer, frozenset(eos), quant)


def check_quantization(source: ModelSource, quantization: str | None) -> None:
    if quantization is None:
        return
    if quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization: must be one of {list(QUANTIZATION_METHODS)} or unset, got {quantization!r}")
    if (quantization == "gguf") != (source.kind == "gguf"):
        what, fits = (("a GGUF file", "'gguf'") if source.kind == "gguf"
                      else ("a Hugging Face folder", "the checkpoint's own method (fp8)"))
        raise ValueError(f"quantization: {quantization!r} does not apply to {what} ({source.path}); {fits} does, "
                         "or leave it unset")


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes the model's parameters take in memory (a tied embedding counted once)."""
    seen = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    return sum(seen.values())


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
            return load_gguf_tokenizer(source.path)
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
           tp: TensorParallel | None, quant: QuantConfig | None = None,
           quantized: set[tuple[int, str]] = frozenset(), kept: dict[str, int] | None = None) -> DecoderForCausalLM:
    with torch.device("meta"):
        model = DecoderForCausalLM(arch, max_positions, shard, tp)
    model.quant_config, model.gguf_types = quant, kept or {}
    use_fp8_linears(model, quant, quantized)
    use_gguf_modules(model, kept or {})
    model.to_empty(device=device)
    model.to(dtype)
    for module in model.modules():
        if isinstance(module, Fp8Linear):
            module.keep_scales_float32()
    finish_gguf_modules(model, dtype)
    _load_weights(model, weights, path)
    for rope in model.rotary_embeddings():
        rope.to_device(torch.device(device), dtype)
    return model.eval()


def _load_weights(model: DecoderForCausalLM, weights: Iterable[tuple[str, torch.Tensor]], path: str) -> None:
    params = dict(model.named_parameters())
    filled: set[tuple[str, int]] = set()
    for name, tensor in _unfused(weights, model.cfg):
        if name == "rope_freqs":
            for rope in model.rotary_embeddings():
                rope.apply_freq_factors(tensor)
            continue
        for param_name, shard in _targets(model, name):
            _copy_into(model, params, param_name, shard, _rank_part(model, name, tensor), name, path, filled)
    missing = [p for p in params if not _all_shards_filled(model, p, filled)]
    if missing:
        raise ModelLoadError(path, f"weights missing for {missing[:5]}{' ...' if len(missing) > 5 else ''}")


def _copy_into(model: DecoderForCausalLM, params: dict, param_name: str, shard: int, tensor: torch.Tensor,
               name: str, path: str, filled: set[tuple[str, int]]) -> None:
    dest = _shard_view(model, params[param_name], param_name, shard)
    if dest.dtype == torch.uint8:  # an Fp8Linear's weight (its bits) or a GGUF layer's blocks
        if tensor.dtype == torch.float8_e4m3fn:
            tensor = tensor.view(torch.uint8)
        elif tensor.dtype != torch.uint8:
            raise ModelLoadError(path, f"tensor {name} is {tensor.dtype} where the checkpoint's scales make it "
                                       "float8_e4m3fn")
    elif tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ModelLoadError(path, f"tensor {name} is {tensor.dtype} without a scale (weight_scale) to read it with")
    elif name.rsplit(".", 1)[-1] in SCALE_NAMES:
        if tensor.shape == (1, 1):  # per tensor: every row of this part
            tensor = tensor.expand(dest.shape)
        elif name.endswith("_inv"):  # block-wise, one row a weight row, rounded up to whole blocks
            tensor = tensor[:dest.shape[0]]
    if tuple(dest.shape) != tuple(tensor.shape):
        raise ModelLoadError(path, f"tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
    with torch.no_grad():
        dest.copy_(tensor)
    filled.add((param_name, shard))


# HF sub-name of a layer's module -> (our sub-name, fused shard index)
_COMMON = {
    "self_attn.q_proj": ("attn.qkv_proj", 0), "self_attn.k_proj": ("attn.qkv_proj", 1),
    "self_attn.v_proj": ("attn.qkv_proj", 2), "self_attn.o_proj": ("attn.o_proj", 0),
    "self_attn.q_norm": ("attn.q_norm", 0), "self_attn.k_norm": ("attn.k_norm", 0),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0), "mlp.up_proj": ("mlp.gate_up_proj", 1),
    "mlp.down_proj": ("mlp.down_proj", 0), "input_layernorm": ("input_norm", 0),
    # the pre-MLP norm (Llama's name); Gemma's post_attention_layernorm normalises the attention's output
    "post_attention_layernorm": ("mlp_norm", 0),
}
_GEMMA = {**_COMMON, "post_attention_layernorm": ("attn_out_norm", 0),
          "pre_feedforward_layernorm": ("mlp_norm", 0), "post_feedforward_layernorm": ("mlp_out_norm", 0)}
# experts: (HF module pattern -> our parameter, which half of gate_up (None: down))
_EXPERT_RE = re.compile(r"(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)$")
_EXPERT_PART = {"w1": 0, "gate_proj": 0, "w3": 1, "up_proj": 1, "w2": None, "down_proj": None}
_ROUTER = {"block_sparse_moe.gate", "mlp.gate"}
_FUSED_QKV_RE = re.compile(r"(.+\.self_attn)\.qkv_proj\.(weight|bias)$")


def _layer_target(cfg: ModelArchConfig, module: str) -> tuple[str, int] | None:
    """Our (sub-name, shard) for one module of an HF layer; None for what we do not use."""
    if cfg.num_experts:
        if module in _ROUTER:
            return "mlp.gate", 0
        m = _EXPERT_RE.match(module)
        if m is not None:
            expert, part = int(m.group(1)), _EXPERT_PART[m.group(2)]
            if part is None:
                return "mlp.experts_down", expert
            return "mlp.experts_gate_up", 2 * expert + part
    return (_GEMMA if cfg.gemma_norms else _COMMON).get(module)


def _targets(model: DecoderForCausalLM, name: str) -> list[tuple[str, int]]:
    """Our parameters (name, fused shard) an HF tensor fills: none for tensors we do not use
    or another pipeline stage holds; two for a tied embedding a split model keeps twice."""
    shard = model.shard
    if name == "model.embed_tokens.weight":
        targets = [("embed_tokens.weight", 0)] if model.embed_tokens is not None else []
        head = model.lm_head
        if model.cfg.tie_word_embeddings and head is not None and (
                model.embed_tokens is None or head.weight is not model.embed_tokens.weight):  # not one shared tensor
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
    target = _layer_target(model.cfg, module)
    if target is None or kind in UNUSED_SCALES:
        return []  # e.g. rotary_emb.inv_freq buffers of old checkpoints; activation scales (weight-only fp8)
    ours, fused = target
    if kind in SCALE_NAMES:
        kind = "weight_scale"  # both name a scale that multiplies (fp8_linear.py)
    param = f"{ours}.{kind}" if not ours.startswith("mlp.experts_") else ours
    return [(f"layers.{int(m.group(1)) - shard.layers.start}.{param}", fused)]


def _unfused(weights: Iterable[tuple[str, torch.Tensor]], cfg: ModelArchConfig) -> Iterable[tuple[str, torch.Tensor]]:
    """Phi-3 stores q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj`: each is read
    as its parts, so that tensor parallelism narrows them like any other checkpoint's."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for name, tensor in weights:
        qkv = _FUSED_QKV_RE.match(name)
        if qkv is not None:
            for part, rows in zip(("q_proj", "k_proj", "v_proj"), tensor.split([q, kv, kv])):
                yield f"{qkv.group(1)}.{part}.{qkv.group(2)}", rows
        elif name.endswith(".mlp.gate_up_proj.weight"):
            prefix = name[:-len(".gate_up_proj.weight")]
            gate, up = tensor.chunk(2)
            yield f"{prefix}.gate_proj.weight", gate
            yield f"{prefix}.up_proj.weight", up
        else:
            yield name, tensor


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


def _split_of(cfg: ModelArchConfig, module: str) -> tuple[int, str] | None:
    if cfg.num_experts:
        m = _EXPERT_RE.match(module)
        if m is not None:
            return (1 if _EXPERT_PART[m.group(2)] is None else 0), "moe_intermediate"
    return _SPLIT.get(module)


def _rank_part(model: DecoderForCausalLM, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of an HF tensor (itself when nothing is split)."""
    shard = model.shard
    if name.rsplit(".", 1)[-1] in SCALE_NAMES:
        m = _LAYER_RE.match(name)
        return scale_part(model, name, tensor, _split_of(model.cfg, m.group(2).rpartition(".")[0]) if m else None)
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
    split = _split_of(model.cfg, module)
    if split is None or (kind == "bias" and split[0] == 1):
        return tensor  # norms, the router; a row-parallel bias is added once, after the sum
    dim, field = split
    units = getattr(shard, field)  # heads (head_dim rows each) or MLP columns
    width = model.cfg.head_dim if field.endswith("heads") else 1
    start, length = units.start * width, len(units) * width
    if dim == 1 and tensor.dtype == torch.uint8:  # GGUF blocks: columns split by whole blocks
        return narrow_gguf_columns(tensor, model.gguf_types[name], start, length, name)
    return tensor.narrow(dim, start, length)


def _shard_sizes(model: DecoderForCausalLM, param_name: str) -> list[int]:
    """The fused parts of a parameter, as this rank holds them."""
    cfg, shard = model.cfg, model.shard
    if ".qkv_proj." in param_name:
        kv = len(shard.kv_heads) * cfg.head_dim
        return [len(shard.q_heads) * cfg.head_dim, kv, kv]
    if ".gate_up_proj." in param_name:
        return [len(shard.intermediate)] * 2
    return []


def _shard_view(model: DecoderForCausalLM, param: torch.Tensor, param_name: str, shard: int) -> torch.Tensor:
    if param_name.endswith("experts_gate_up"):  # [experts, 2 * intermediate, hidden]: expert, then half
        size = len(model.shard.moe_intermediate)
        return param.data[shard // 2].narrow(0, (shard % 2) * size, size)
    if param_name.endswith("experts_down"):
        return param.data[shard]
    sizes = _shard_sizes(model, param_name)
    if not sizes:
        return param.data
    start = sum(sizes[:shard])
    return param.data.narrow(0, start, sizes[shard])


def _all_shards_filled(model: DecoderForCausalLM, param_name: str, filled: set[tuple[str, int]]) -> bool:
    if param_name.endswith("experts_gate_up"):
        num = 2 * model.cfg.num_experts
    elif param_name.endswith("experts_down"):
        num = model.cfg.num_experts
    else:
        num = len(_shard_sizes(model, param_name)) or 1
    return all((param_name, s) in filled for s in range(num))
