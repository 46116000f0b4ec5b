"""A Llama-family decoder (Llama, Mistral, Qwen2) running on the paged KV cache.

One forward serves the whole flat batch of a step: tokens of every request side by side,
positions and cache slots given per token, attention delegated to the backend.

Built from a ModelShard (engine/model/shard.py), a module holds only its rank's part of
the weights; `tp` sums the row-parallel partial outputs and gathers the vocabulary-parallel
logits across the stage's ranks (engine/executor/groups.py). Whole (the default), nothing
is split and `tp` is never called.
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.backend import AttentionBackend, AttentionMetadata
from engine.config import ModelArchConfig
from engine.model.packed_linear import PackedLinear, prepack_linears
from engine.model.rope import RotaryEmbedding
from engine.model.shard import ModelShard


class TensorParallel(Protocol):
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...
    def all_gather(self, x: torch.Tensor) -> torch.Tensor: ...  # concatenated along the last dim


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 statistics, as the reference implementation computes them
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelArchConfig, rope: RotaryEmbedding, shard: ModelShard, tp: TensorParallel | None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = len(shard.q_heads), len(shard.kv_heads), cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.tp = tp
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.rope = rope
        self.scale = cfg.head_dim ** -0.5

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rope(positions, q, k)
        out = self.o_proj(backend.forward(q, k, v, kv_cache, meta, self.scale).reshape(-1, self.q_size))
        return out if self.tp is None else self.tp.all_reduce(out)


class MLP(nn.Module):
    def __init__(self, cfg: ModelArchConfig, shard: ModelShard, tp: TensorParallel | None):
        super().__init__()
        self.intermediate_size = len(shard.intermediate)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, cfg.hidden_size, bias=False)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        out = self.down_proj(F.silu(gate) * up)
        return out if self.tp is None else self.tp.all_reduce(out)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, rope: RotaryEmbedding, shard: ModelShard, tp: TensorParallel | None):
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, rope, shard, tp)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, shard, tp)

    def forward(self, x, positions, kv_cache, meta, backend):
        x = x + self.attn(self.input_norm(x), positions, kv_cache, meta, backend)
        return x + self.mlp(self.post_attn_norm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelArchConfig, max_positions: int, shard: ModelShard | None = None,
                 tp: TensorParallel | None = None):
        super().__init__()
        self.cfg = cfg
        self.shard = shard = shard or ModelShard.whole(cfg)
        self.tp = tp if shard.tp_size > 1 else None
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, max_positions)
        vocab_rows = cfg.vocab_size if shard.tp_size == 1 else shard.vocab_shard_size
        self.embed_tokens = nn.Embedding(vocab_rows, cfg.hidden_size) if shard.is_first_stage else None
        self.layers = nn.ModuleList(DecoderLayer(cfg, self.rope, shard, self.tp) for _ in shard.layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if shard.is_last_stage else None
        # Whole and tied, the head is the embedding itself; split, a stage that does not
        # embed still needs those rows, so it keeps its own (loaded from either tensor).
        tied_here = cfg.tie_word_embeddings and shard.is_whole
        self.lm_head = (nn.Linear(cfg.hidden_size, vocab_rows, bias=False)
                        if shard.is_last_stage and not tied_here else None)

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
            return self.embed_tokens(input_ids)
        # vocabulary-parallel: each rank looks up the ids in its rows, zeros elsewhere; the sum is exact
        vocab = self.shard.vocab
        inside = (input_ids >= vocab.start) & (input_ids < vocab.stop)
        x = self.embed_tokens(torch.where(inside, input_ids - vocab.start, 0))
        return self.tp.all_reduce(x * inside.unsqueeze(-1).to(x.dtype))

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
            return F.linear(x, self.embed_tokens.weight).float()
        logits = self.lm_head(x).float()
        if self.tp is None:
            return logits
        return self.tp.all_gather(logits)[:, :self.cfg.vocab_size]  # the padding rows dropped

    def prepack(self) -> None:
        """Prepack every linear layer's weight for CPU decode steps (see packed_linear.py),
        the LM head too, tied or not. Idempotent."""
        prepack_linears(self)
        if self.lm_head is None and self.embed_tokens is not None and self.shard.is_last_stage:
            self.lm_head = PackedLinear(self.embed_tokens.weight, None)
