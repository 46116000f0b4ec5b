"""What every rank does with a step and with KV blocks: run its stage's layers on each
micro-batch, and read/write its part of the KV cache. The driver (rank 0) and the rank
processes run this same code."""
from __future__ import annotations

import torch

from pdserve.engine.attention.backend import AttentionBackend
from pdserve.engine.executor.groups import ParallelGroups
from pdserve.engine.executor.messages import StepInputs
from pdserve.engine.kv_transfer import as_tensor
from pdserve.engine.model.decoder import DecoderForCausalLM
from pdserve.engine.model.shard import ModelShard
from pdserve.engine.worker.host_kv_cache import host_kv_cache
from pdserve.engine.worker.kv_cache import export_blocks, import_blocks


class StageWorker:
    def __init__(self, model: DecoderForCausalLM, kv_caches: list[torch.Tensor], backend: AttentionBackend,
                 groups: ParallelGroups, device: torch.device, num_host_slots: int = 0):
        self.model, self.kv_caches, self.backend = model, kv_caches, backend
        self.groups, self.place, self.device = groups, groups.place, device
        self.shard: ModelShard = model.shard
        self.host_kv = host_kv_cache(kv_caches, num_host_slots)  # the host tier's bytes of this rank's part

    @torch.inference_mode()
    def run(self, batches: list[StepInputs]) -> list[torch.Tensor]:
        """Each micro-batch through this stage's layers, one after the other: a stage sends
        micro-batch i on (without waiting) and starts i + 1 while the next stage runs i.
        Returns the logits of every micro-batch on the driver, nothing elsewhere."""
        place, model = self.place, self.model
        sends, logits = [], []
        for batch in batches:
            if place.is_first_stage:
                x = model.embed(batch.input_ids)
            else:
                x = torch.empty(batch.num_tokens, model.cfg.hidden_size, dtype=self._dtype, device=self.device)
                self.groups.device.recv(x, src=place.peer(place.pp_rank - 1))
            x = model.run_layers(x, batch.positions, self.kv_caches, batch.meta, self.backend)
            if not place.is_last_stage:
                sends.append(self.groups.device.isend(x, dst=place.peer(place.pp_rank + 1)))
                continue
            rows = model.compute_logits(x, batch.logits_indices)
            if place.rank == 0:
                logits.append(rows)
            elif place.tp_rank == 0:  # the stage's ranks all hold the gathered logits; one sends
                sends.append(self.groups.device.isend(rows, dst=0))
        if place.rank == 0 and not place.is_last_stage:
            last = place.peer(place.pp_size - 1, 0)
            for batch in batches:
                rows = torch.empty(batch.logits_indices.shape[0], model.cfg.vocab_size, dtype=torch.float32,
                                   device=self.device)
                self.groups.device.recv(rows, src=last)
                logits.append(rows)
        for work in sends:
            work.wait()
        return logits

    @property
    def _dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def import_blocks(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        """`blocks` whole ([n, layers, 2, bs, kv heads, d]); this rank keeps its layers and heads."""
        layers, heads = self.shard.layers, self.shard.kv_heads
        part = as_tensor(blocks)[:, layers.start:layers.stop, :, :, heads.start:heads.stop]
        import_blocks(self.kv_caches, block_ids, part)

    def export_part(self, block_ids: list[int]) -> torch.Tensor:
        """This rank's layers and KV heads of the blocks, on the host."""
        return export_blocks(self.kv_caches, block_ids)

    def copy_host_blocks(self, offloads: list[tuple[int, int]], onloads: list[tuple[int, int]]) -> None:
        self.host_kv.copy(offloads, onloads)
