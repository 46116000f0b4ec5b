"""The single-rank executor: the Executor contract over one process's model and cache."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pdserve.engine.attention.backend import AttentionMetadata
from pdserve.engine.executor.base import Executor
from pdserve.engine.executor.local import LocalExecutor
from pdserve.engine.worker.step_batch import StepInputs


class RecordingModel:
    def __init__(self):
        self.calls = []

    def __call__(self, input_ids, positions, kv_caches, meta, backend, logits_indices):
        self.calls.append((kv_caches, backend))
        return torch.zeros(logits_indices.shape[0], 7)


def executor_over(model, num_layers: int = 2) -> tuple[LocalExecutor, list[torch.Tensor]]:
    loaded = SimpleNamespace(arch="arch", model=model)
    executor = LocalExecutor(loaded)
    caches = [torch.zeros(2, 4, 2, 1, 3) for _ in range(num_layers)]  # [K/V, blocks, bs, heads, d]
    executor.start_kv(4, caches, backend="backend")
    return executor, caches


def inputs(num_tokens: int) -> StepInputs:
    meta = AttentionMetadata(num_tokens, torch.arange(num_tokens + 1, dtype=torch.int32),
                             torch.ones(num_tokens, dtype=torch.int32), torch.zeros(num_tokens, 1, dtype=torch.int32),
                             torch.arange(num_tokens), 1, 1)
    return StepInputs(torch.arange(num_tokens), torch.zeros(num_tokens, dtype=torch.long), meta,
                      torch.arange(num_tokens))


def test_it_is_an_executor_of_the_whole_model_with_one_micro_batch():
    executor, _ = executor_over(RecordingModel())
    assert isinstance(executor, Executor) and executor.holds_whole_model and executor.num_microbatches == 1
    assert executor.kv_arch == "arch"
    executor.check_health()
    executor.shutdown()  # nothing to stop


def test_forward_runs_the_model_over_its_cache_and_backend():
    model = RecordingModel()
    executor, caches = executor_over(model)
    assert executor.forward([inputs(3)]).shape == (3, 7)
    assert model.calls == [(caches, "backend")]


def test_forward_takes_exactly_one_micro_batch():
    executor, _ = executor_over(RecordingModel())
    with pytest.raises(ValueError):
        executor.forward([inputs(1), inputs(1)])


def test_blocks_imported_come_back_out_unchanged():
    executor, caches = executor_over(RecordingModel())
    blocks = torch.randn(2, len(caches), 2, 2, 1, 3)  # [n, layers, K/V, bs, heads, d]
    executor.import_blocks([3, 1], blocks)
    assert torch.equal(executor.export_blocks([3, 1]), blocks)
    assert not caches[0][:, 0].any() and not caches[1][:, 2].any()  # the other blocks untouched
