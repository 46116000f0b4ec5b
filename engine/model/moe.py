"""A routed mixture of experts in place of a layer's MLP (Mixtral, Qwen3-MoE).

    router logits = gate(x)            [tokens, experts]
    p = softmax(logits) in fp32, its top-k per token (renormalised to sum 1 where the
        model does: Mixtral always, Qwen3-MoE when norm_topk_prob)
    out[t] = sum over t's k experts e of p[t, e] * down_e(act(gate_e(x[t])) * up_e(x[t]))

Experts run as a loop over the experts this step's tokens chose, each on its tokens as one
GEMM (correctness first; a grouped GEMM kernel is the GPU's next step). Under tensor
parallelism every rank holds every expert's slice of the intermediate size, as a dense MLP
is split, and the partial outputs are summed by the caller's all-reduce.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.config import ModelArchConfig
from pdserve.engine.model.shard import ModelShard


class MixtureOfExperts(nn.Module):
    def __init__(self, cfg: ModelArchConfig, shard: ModelShard, tp, act: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.num_experts, self.top_k = cfg.num_experts, cfg.num_experts_per_tok
        self.intermediate_size = len(shard.moe_intermediate)
        self.renormalize = cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # the router, whole on every rank
        self.experts_gate_up = nn.Parameter(torch.empty(cfg.num_experts, 2 * self.intermediate_size, cfg.hidden_size))
        self.experts_down = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size, self.intermediate_size))
        self.act = act
        self.tp = tp

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [tokens, k] fp32, experts [tokens, k]) of every token."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        out = torch.zeros_like(x)
        for e in torch.unique(experts).tolist():
            tokens, slot = torch.where(experts == e)
            gate, up = F.linear(x[tokens], self.experts_gate_up[e]).split(self.intermediate_size, dim=-1)
            y = F.linear(self.act(gate) * up, self.experts_down[e])
            out.index_add_(0, tokens, (y * weights[tokens, slot, None]).to(x.dtype))
        return out if self.tp is None else self.tp.all_reduce(out)
