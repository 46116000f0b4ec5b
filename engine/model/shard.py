"""Which part of the model one tensor/pipeline-parallel rank holds.

Tensor parallelism (Megatron-style) splits each layer over the t ranks of a stage:
QKV and gate/up by output rows (column-parallel), o_proj and down_proj by input columns
(row-parallel, their partial outputs summed by an all-reduce), the embedding and the LM
head by vocabulary rows. The KV cache follows the KV heads: each rank keeps the heads its
query heads read. With more ranks than KV heads, a KV head is replicated on the ranks
whose query heads share it (t = 4 on 2 KV heads: ranks 0-1 hold head 0, ranks 2-3 head 1).

Pipeline parallelism gives each stage a contiguous range of layers; the first stage
embeds, the last normalises and computes logits.
"""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.config import ModelArchConfig
from pdserve.engine.errors import InvalidRequestError


@dataclass(frozen=True)
class ModelShard:
    tp_rank: int
    tp_size: int
    q_heads: range          # the query heads this rank computes
    kv_heads: range         # the KV heads it keeps (replicated ones included)
    intermediate: range     # its slice of the MLP's intermediate size
    vocab: range            # its rows of the embedding and LM head (unpadded)
    vocab_shard_size: int   # every rank's row count, the last one padded with zero rows
    layers: range           # the model's layers this rank's pipeline stage runs
    is_first_stage: bool
    is_last_stage: bool
    # the first rank holding its KV heads: it exports them (replicas would send copies)
    owns_kv_heads: bool
    moe_intermediate: range = range(0)  # its slice of every expert's intermediate size

    @property
    def is_whole(self) -> bool:
        return self.tp_size == 1 and self.is_first_stage and self.is_last_stage

    @classmethod
    def whole(cls, arch: ModelArchConfig) -> ModelShard:
        return cls.of(arch, 0, 1, range(arch.num_layers), True, True)

    @classmethod
    def of(cls, arch: ModelArchConfig, tp_rank: int, tp_size: int, layers: range,
           is_first_stage: bool, is_last_stage: bool) -> ModelShard:
        check_tensor_parallel(arch, tp_size)
        t, nh, nkv = tp_size, arch.num_heads, arch.num_kv_heads
        per_q = nh // t
        if t <= nkv:
            per_kv = nkv // t
            kv_start, owns = tp_rank * per_kv, True
        else:  # replicated: t // nkv ranks share each KV head
            per_kv, share = 1, t // nkv
            kv_start, owns = tp_rank // share, tp_rank % share == 0
        per_i = arch.intermediate_size // t
        per_e = arch.moe_intermediate_size // t
        per_v = -(-arch.vocab_size // t)
        v_start = min(tp_rank * per_v, arch.vocab_size)
        return cls(tp_rank, t, range(tp_rank * per_q, (tp_rank + 1) * per_q), range(kv_start, kv_start + per_kv),
                   range(tp_rank * per_i, (tp_rank + 1) * per_i),
                   range(v_start, min(v_start + per_v, arch.vocab_size)), per_v, layers,
                   is_first_stage, is_last_stage, owns, range(tp_rank * per_e, (tp_rank + 1) * per_e))


def check_tensor_parallel(arch: ModelArchConfig, tp_size: int) -> None:
    """t must divide the query heads and the MLP, and either divide the KV heads or be a
    multiple of them (then KV heads are replicated)."""
    nh, nkv = arch.num_heads, arch.num_kv_heads
    problems = []
    if nh % tp_size:
        problems.append(f"the model's {nh} attention heads")
    if nkv % tp_size and tp_size % nkv:
        problems.append(f"the model's {nkv} KV heads (t must divide them or be a multiple of them)")
    if arch.num_experts and arch.moe_intermediate_size % tp_size:
        problems.append(f"its experts' MLP size {arch.moe_intermediate_size}")
    elif not arch.num_experts and arch.intermediate_size % tp_size:
        problems.append(f"its MLP size {arch.intermediate_size}")
    if problems:
        raise InvalidRequestError("tensor_parallel_size", f"{tp_size} does not divide " + " nor ".join(problems))
