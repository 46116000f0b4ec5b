"""The decoder every supported architecture is: Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3,
Mixtral and Qwen3-MoE, running on the paged KV cache.

One forward serves the whole flat batch of a step: tokens of every request side by side,
positions and cache slots given per token, attention delegated to the backend. What tells
the architectures apart is read from their configs into ModelArchConfig (engine/model/arch.py,
by each one's row of engine/model/arch_table.py) and switched on here per layer:

    layer_windows         a windowed layer attends the last W positions (Mistral, Gemma local layers)
    qk_norm               RMSNorm over each head's q and k before RoPE (Qwen3, Gemma 3)
    gemma_norms           (1 + w) norms, a norm after attention and after the MLP too, the
                          embedding scaled by sqrt(hidden); gelu(tanh) MLP (Gemma)
    *_softcap             cap * tanh(x / cap) on attention scores and on logits (Gemma 2)
    local_rope_theta      windowed layers rotate with their own base (Gemma 3)
    num_experts           a routed mixture of experts in place of the MLP (Mixtral, Qwen3-MoE)

Built from a ModelShard (engine/model/shard.py), a module holds only its rank's part of
the weights; `tp` sums the row-parallel partial outputs and gathers the vocabulary-parallel
logits across the stage's ranks (engine/executor/groups.py). Whole (the default), nothing
is split and `tp` is never called.
"""
from __future__ import annotations

import logging
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.attention.backend import AttentionBackend, AttentionMetadata
from pdserve.engine.config import ModelArchConfig
from pdserve.engine.model.arch import embedding_scale
from pdserve.engine.model.moe import MixtureOfExperts
from pdserve.engine.model.fp8_linear import Fp8Linear
from pdserve.engine.model.gguf_linear import GGUFEmbedding, GGUFLinear
from pdserve.engine.model.packed_linear import PackedLinear, prepack_linears
from pdserve.engine.model.rope import RotaryEmbedding
from pdserve.engine.model.shard import ModelShard
from pdserve.kernels import cpu as cpu_ops

logger = logging.getLogger(__name__)


class TensorParallel(Protocol):
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...
    def all_gather(self, x: torch.Tensor) -> torch.Tensor: ...  # concatenated along the last dim


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.offset = offset  # Gemma: scales by (1 + w), in fp32
        self.fused = False  # the C++ op on CPU (kernels/cpu/fused_ops.cpp): DecoderForCausalLM.prepack

    def _fusable(self, *xs: torch.Tensor) -> bool:
        return self.fused and all(x.dim() == 2 and x.stride(-1) == 1 and x.dtype == self.weight.dtype for x in xs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fusable(x):
            return cpu_ops.rms_norm(x, self.weight, self.eps, self.offset)
        # fp32 statistics, as the reference implementations compute them
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (h * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * h.to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + h), x + h): a decoder layer's residual add and the next norm, one op on CPU."""
        if self._fusable(x, h):
            return cpu_ops.fused_add_rms_norm(x, h, self.weight, self.eps, self.offset)
        total = x + h
        return self(total), total


def activation(name: str):
    if name == "gelu_pytorch_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    return F.silu


class Attention(nn.Module):
    def __init__(self, cfg: ModelArchConfig, layer: int, rope: RotaryEmbedding, shard: ModelShard,
                 tp: TensorParallel | None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = len(shard.q_heads), len(shard.kv_heads), cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.tp = tp
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.rope = rope
        self.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, offset=cfg.gemma_norms)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, offset=cfg.gemma_norms)
        else:
            self.q_norm = self.k_norm = None
        # only what is on goes to the backend: window W, the scores' soft-cap
        window = cfg.window_of(layer)
        self.attn_options = {k: v for k, v in (("window", window), ("softcap", cfg.attn_logit_softcap))
                             if v is not None}

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rope(positions, q, k)
        out = backend.forward(q, k, v, kv_cache, meta, self.scale, **self.attn_options)
        out = self.o_proj(out.reshape(-1, self.q_size))
        return out if self.tp is None else self.tp.all_reduce(out)


class MLP(nn.Module):
    def __init__(self, cfg: ModelArchConfig, shard: ModelShard, tp: TensorParallel | None):
        super().__init__()
        self.intermediate_size = len(shard.intermediate)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, cfg.hidden_size, bias=False)
        self.act = activation(cfg.hidden_act)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        out = self.down_proj(self.act(gate) * up)
        return out if self.tp is None else self.tp.all_reduce(out)


class DecoderLayer(nn.Module):
    """x += attn(norm(x)); x += mlp(norm(x)). Gemma also normalises each branch's output
    (its `post_attention_layernorm` and `post_feedforward_layernorm`)."""

    def __init__(self, cfg: ModelArchConfig, layer: int, rope: RotaryEmbedding, shard: ModelShard,
                 tp: TensorParallel | None):
        super().__init__()
        eps, gemma = cfg.rms_norm_eps, cfg.gemma_norms
        self.input_norm = RMSNorm(cfg.hidden_size, eps, offset=gemma)
        self.attn = Attention(cfg, layer, rope, shard, tp)
        self.attn_out_norm = RMSNorm(cfg.hidden_size, eps, offset=True) if gemma else None
        self.mlp_norm = RMSNorm(cfg.hidden_size, eps, offset=gemma)
        self.mlp = MixtureOfExperts(cfg, shard, tp, activation(cfg.hidden_act)) if cfg.num_experts else MLP(cfg, shard, tp)
        self.mlp_out_norm = RMSNorm(cfg.hidden_size, eps, offset=True) if gemma else None

    def forward(self, x, positions, kv_cache, meta, backend):
        h = self.attn(self.input_norm(x), positions, kv_cache, meta, backend)
        if self.attn_out_norm is None:
            normed, x = self.mlp_norm.add_and_norm(x, h)
        else:
            x = x + self.attn_out_norm(h)
            normed = self.mlp_norm(x)
        h = self.mlp(normed)
        return x + (h if self.mlp_out_norm is None else self.mlp_out_norm(h))


class DecoderForCausalLM(nn.Module):
    def __init__(self, cfg: ModelArchConfig, max_positions: int, shard: ModelShard | None = None,
                 tp: TensorParallel | None = None):
        super().__init__()
        self.cfg = cfg
        self.shard = shard = shard or ModelShard.whole(cfg)
        self.tp = tp if shard.tp_size > 1 else None
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, max_positions,
                                    partial_rotary_factor=cfg.partial_rotary_factor,
                                    max_position_embeddings=cfg.max_position_embeddings)
        # Gemma 3's windowed layers: their own base, never scaled
        self.local_rope = (RotaryEmbedding(cfg.head_dim, cfg.local_rope_theta, None, max_positions,
                                           partial_rotary_factor=cfg.partial_rotary_factor)
                           if cfg.local_rope_theta is not None else None)
        vocab_rows = cfg.vocab_size if shard.tp_size == 1 else shard.vocab_shard_size
        self.embed_tokens = nn.Embedding(vocab_rows, cfg.hidden_size) if shard.is_first_stage else None
        self.embed_scale = embedding_scale(cfg)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, self._rope_of(i), shard, self.tp) for i in shard.layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset=cfg.gemma_norms) if shard.is_last_stage else None
        # Whole and tied, the head is the embedding itself; split, a stage that does not
        # embed still needs those rows, so it keeps its own (loaded from either tensor).
        tied_here = cfg.tie_word_embeddings and shard.is_whole
        self.lm_head = (nn.Linear(cfg.hidden_size, vocab_rows, bias=False)
                        if shard.is_last_stage and not tied_here else None)

    def _rope_of(self, layer: int) -> RotaryEmbedding:
        if self.local_rope is not None and self.cfg.window_of(layer) is not None:
            return self.local_rope
        return self.rope

    def rotary_embeddings(self) -> list[RotaryEmbedding]:
        return [r for r in (self.rope, self.local_rope) if r is not None]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, backend: AttentionBackend,
                logits_indices: torch.Tensor) -> torch.Tensor:
        """Returns float32 logits for the tokens at `logits_indices` only (a whole model,
        or a single-stage one)."""
        x = self.run_layers(self.embed(input_ids), positions, kv_caches, meta, backend)
        return self.compute_logits(x, logits_indices)

    @torch.inference_mode()
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            x = self.embed_tokens(input_ids)
        else:
            # vocabulary-parallel: each rank looks up the ids in its rows, zeros elsewhere; the sum is exact
            vocab = self.shard.vocab
            inside = (input_ids >= vocab.start) & (input_ids < vocab.stop)
            x = self.embed_tokens(torch.where(inside, input_ids - vocab.start, 0))
            x = self.tp.all_reduce(x * inside.unsqueeze(-1).to(x.dtype))
        if self.embed_scale is not None:  # rounded to the weights' dtype first, as Gemma's reference does
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype, device=x.device)
        return x

    @torch.inference_mode()
    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                   meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        """This stage's layers on the hidden states (residual stream) of the flat batch."""
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, positions, kv_cache, meta, backend)
        return x

    @torch.inference_mode()
    def compute_logits(self, x: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        x = self.norm(x[logits_indices])
        if self.lm_head is None:  # tied to the embedding, not prepacked
            logits = F.linear(x, self.embed_tokens.weight).float()
        else:
            logits = self.lm_head(x).float()
            if self.tp is not None:
                logits = self.tp.all_gather(logits)[:, :self.cfg.vocab_size]  # the padding rows dropped
        cap = self.cfg.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    @property
    def dtype(self) -> torch.dtype:
        """The dtype it computes in (the norms'; quantized weights are held in bytes)."""
        return next(p.dtype for p in self.parameters() if p.dtype.is_floating_point)

    def prepack(self) -> None:
        """Prepares the model for CPU steps: every linear layer's weight prepacked for oneDNN
        (see packed_linear.py), the LM head too, tied or not; norms and RoPE on the C++ ops of
        kernels/cpu/fused_ops.cpp and decode batches of a few rows on skinny_linear.cpp when
        they build. Idempotent."""
        prepack_linears(self)
        if self.lm_head is None and self.embed_tokens is not None and self.shard.is_last_stage:
            self.lm_head = PackedLinear(self.embed_tokens.weight, None)
        self._use_fused_cpu_ops()

    def _use_fused_cpu_ops(self) -> None:
        from pdserve.kernels.cpu.build import CpuKernelBuildError, load_library
        try:
            load_library()
        except CpuKernelBuildError as e:  # the torch ops compute the same; only slower
            logger.warning("norms and RoPE run as torch ops: %s", e)
            return
        for module in self.modules():
            if isinstance(module, (RMSNorm, RotaryEmbedding)):
                module.fused = True
            elif isinstance(module, (PackedLinear, Fp8Linear, GGUFLinear, GGUFEmbedding)):
                module.use_skinny_kernel()
