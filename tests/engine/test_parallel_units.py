"""The pieces of tensor/pipeline parallelism that need no second process: which heads,
rows and layers each rank holds, the step message's encoding, the micro-batch split."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from pdserve.engine.attention.backend import AttentionMetadata
from pdserve.engine.config import ModelArchConfig
from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.executor.config import ParallelConfig
from pdserve.engine.executor.groups import RankPlace
from pdserve.engine.executor.launch import RankLaunch, rank_kv_arch, rank_shard
from pdserve.engine.executor.messages import StepInputs, pack_step, unpack_step
from pdserve.engine.model.shard import ModelShard, check_tensor_parallel

SMOLLM2 = ModelArchConfig("llama", 49152, 576, 1536, 30, 9, 3, 64, 1e-5, 1e5, 8192, True)
TINY = dataclasses.replace(SMOLLM2, vocab_size=49153, hidden_size=64, intermediate_size=128, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=16)


def test_smollm2_t3_gives_each_rank_three_query_heads_and_their_kv_head():
    shards = [ModelShard.of(SMOLLM2, r, 3, range(30), True, True) for r in range(3)]
    assert [s.q_heads for s in shards] == [range(0, 3), range(3, 6), range(6, 9)]
    assert [s.kv_heads for s in shards] == [range(0, 1), range(1, 2), range(2, 3)]
    assert [s.intermediate for s in shards] == [range(0, 512), range(512, 1024), range(1024, 1536)]
    assert all(s.owns_kv_heads for s in shards)
    # each rank's query heads read the KV head it keeps (GQA: 3 query heads per KV head)
    for s in shards:
        assert {h // 3 for h in s.q_heads} == set(s.kv_heads)


def test_more_ranks_than_kv_heads_replicates_them_and_one_replica_owns_each():
    shards = [ModelShard.of(TINY, r, 4, range(2), True, True) for r in range(4)]
    assert [s.kv_heads for s in shards] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    assert [s.owns_kv_heads for s in shards] == [True, False, True, False]
    for s in shards:
        assert {h // 2 for h in s.q_heads} == set(s.kv_heads)


def test_vocabulary_rows_are_padded_to_equal_shards():
    shards = [ModelShard.of(TINY, r, 2, range(2), True, True) for r in range(2)]
    assert [s.vocab for s in shards] == [range(0, 24577), range(24577, 49153)]
    assert {s.vocab_shard_size for s in shards} == {24577}  # the second one padded by one row


@pytest.mark.parametrize("t,problem", [(3, "attention heads"), (8, "attention heads")])
def test_tensor_parallel_sizes_the_model_cannot_take_are_refused(t, problem):
    with pytest.raises(InvalidRequestError, match=f"tensor_parallel_size: {t} does not divide.*{problem}"):
        check_tensor_parallel(TINY, t)


def test_kv_heads_neither_divided_nor_a_multiple_are_refused():
    arch = dataclasses.replace(TINY, num_heads=6, num_kv_heads=3, intermediate_size=96)
    with pytest.raises(InvalidRequestError, match="3 KV heads"):
        check_tensor_parallel(arch, 2)


def test_pipeline_stages_split_layers_evenly_or_as_told():
    assert ParallelConfig(pipeline_parallel_size=2).stage_layers(30) == [range(0, 15), range(15, 30)]
    assert ParallelConfig(pipeline_parallel_size=3).stage_layers(7) == [range(0, 3), range(3, 5), range(5, 7)]
    split = ParallelConfig(pipeline_parallel_size=2, pipeline_layer_split=(20, 10))
    assert split.stage_layers(30) == [range(0, 20), range(20, 30)]
    with pytest.raises(InvalidRequestError, match="pipeline_parallel_size: 3 stages for a model of 2 layers"):
        ParallelConfig(pipeline_parallel_size=3).stage_layers(2)


def test_rank_places_and_shards_of_a_t2_p2_engine():
    parallel = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2)
    places = [RankPlace(r, 2, 2) for r in range(4)]
    assert [(p.pp_rank, p.tp_rank) for p in places] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    shards = [rank_shard(p, parallel, TINY) for p in places]
    assert [s.layers for s in shards] == [range(0, 1)] * 2 + [range(1, 2)] * 2
    assert [(s.is_first_stage, s.is_last_stage) for s in shards] == [(True, False)] * 2 + [(False, True)] * 2
    kv = rank_kv_arch(parallel, TINY)
    assert (kv.num_layers, kv.num_kv_heads) == (1, 1)


def test_rank_launch_round_trips_through_json():
    launch = RankLaunch(2, "smollm2", "float32", "cpu", "cpu", None, 16,
                        ParallelConfig(2, 2, pipeline_layer_split=(20, 10)), "gloo", 12345, 1)
    assert RankLaunch.from_json(launch.to_json()) == launch


def test_step_inputs_survive_the_wire_encoding():
    def batch(n_tokens, n_seqs, max_blocks, n_logits, seed):
        g = torch.Generator().manual_seed(seed)
        meta = AttentionMetadata(
            num_decodes=1, query_start_loc=torch.randint(0, 100, (n_seqs + 1,), generator=g, dtype=torch.int32),
            seq_lens=torch.randint(0, 100, (n_seqs,), generator=g, dtype=torch.int32),
            block_tables=torch.randint(0, 100, (n_seqs, max_blocks), generator=g, dtype=torch.int32),
            slot_mapping=torch.randint(0, 1000, (n_tokens,), generator=g), max_query_len=7, max_seq_len=99)
        return StepInputs(torch.randint(0, 50000, (n_tokens,), generator=g), torch.arange(n_tokens), meta,
                          torch.arange(n_logits))
    batches = [batch(9, 3, 4, 2, 0), batch(5, 1, 2, 1, 1)]
    shapes, payload = pack_step(batches)
    assert payload.dtype == torch.int64
    for sent, got in zip(batches, unpack_step(shapes, payload, torch.device("cpu"))):
        for name in ("input_ids", "positions", "logits_indices"):
            assert torch.equal(getattr(sent, name), getattr(got, name))
        for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
            assert torch.equal(getattr(sent.meta, name), getattr(got.meta, name))
            assert getattr(sent.meta, name).dtype == getattr(got.meta, name).dtype
        assert (got.meta.num_decodes, got.meta.max_query_len, got.meta.max_seq_len) == (1, 7, 99)


@pytest.mark.parametrize("counts,parts,expected", [
    ({"a": 1, "b": 1, "c": 1, "d": 1}, 2, [["a", "b"], ["c", "d"]]),
    ({"p": 60, "a": 1, "b": 1}, 2, [["a", "b"], ["p"]]),      # decodes first, the prefill alone
    ({"a": 1, "b": 30, "c": 30}, 3, [["a"], ["b"], ["c"]]),
    ({"a": 1}, 2, [["a"]]),                                   # never an empty micro-batch
    ({"a": 1, "b": 1, "c": 1}, 1, [["a", "b", "c"]]),         # micro-batching off
])
def test_a_step_is_cut_into_micro_batches_of_about_equal_tokens(counts, parts, expected):
    from types import SimpleNamespace

    from pdserve.engine.core.scheduler_output import SchedulerOutput
    from pdserve.engine.worker.model_runner import ModelRunner
    runner = SimpleNamespace(executor=SimpleNamespace(num_microbatches=parts))
    sched = SchedulerOutput(num_scheduled_tokens=counts, total_num_scheduled_tokens=sum(counts.values()))
    assert ModelRunner._microbatches(runner, sched) == expected
