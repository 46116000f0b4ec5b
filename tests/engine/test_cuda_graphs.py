"""Decode graphs (engine/worker/cuda_graphs.py) on CPU: EagerGraph stands in for the capture,
so bucketing, padding and the reuse of static buffers run as on a GPU, and every result is
compared with the eager runner's. The capture itself needs CUDA: bench/gpu_engine.py checks it
(graph vs eager tokens) on a GPU machine."""
from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine import EngineConfig, SamplingParams, SchedulerConfig
from pdserve.engine.attention.backend import AttentionMetadata
from pdserve.engine.attention.selector import get_attention_backend
from pdserve.engine.core.scheduler_output import NewRequestData, SchedulerOutput
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.model.loader import load_model
from pdserve.engine.model.source import resolve_model
from pdserve.engine.worker.cuda_graphs import DecodeGraphs, EagerGraph, sizes_to_capture
from pdserve.engine.worker.kv_cache import allocate_kv_caches
from pdserve.engine.executor.local import LocalExecutor
from pdserve.engine.worker.model_runner import ModelRunner
from pdserve.engine.engine_request import EngineRequest

SIZES = (1, 2, 4, 8)
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir):
    return load_model(resolve_model(tiny_llama_dir), torch.float32, "cpu", progress=False)


def test_sizes_past_max_num_seqs_are_not_captured():
    assert sizes_to_capture((1, 2, 4, 8, 16, 32, 64), 12) == [1, 2, 4, 8, 16]
    assert sizes_to_capture((8, 1, 4, 4, 2), 64) == [1, 2, 4, 8]
    assert sizes_to_capture((1, 2, 4), 4) == [1, 2, 4]


@pytest.mark.parametrize("kwargs,match", [
    (dict(), "need device 'cuda' and attention_backend 'triton'"),                          # default: cpu
    (dict(device="cuda", attention_backend="torch"), "attention_backend 'torch'"),
    (dict(device="cuda", attention_backend="triton", cuda_graph_batch_sizes=(1, 0)), "positive"),
    (dict(device="cuda", attention_backend="triton", cuda_graph_batch_sizes=[1, 2]), "tuple"),
    (dict(device="cuda", attention_backend="triton", cuda_graph_batch_sizes=(True,)), "positive"),
])
def test_config_rejects_graphs_it_cannot_run(kwargs, match):
    kwargs = {"cuda_graph_batch_sizes": (1, 2, 4), **kwargs}
    with pytest.raises(ValueError, match=f"cuda_graph_batch_sizes: .*{match}"):
        EngineConfig(**kwargs)


def test_config_accepts_graphs_on_cuda_with_triton():
    config = EngineConfig(device="cuda:0", attention_backend="triton", cuda_graph_batch_sizes=(1, 2, 4))
    assert config.cuda_graph_batch_sizes == (1, 2, 4)
    assert EngineConfig().cuda_graph_batch_sizes == ()  # off by default


def test_llm_takes_a_list_and_refuses_graphs_on_cpu_before_loading_anything():
    from pdserve.engine import LLM
    with pytest.raises(ValueError, match="cuda_graph_batch_sizes: CUDA graphs need device 'cuda'"):
        LLM("no-such-model", cuda_graph_batch_sizes=[1, 2, 4])


def decode_meta(seq_lens: list[int], num_prefill_tokens: int = 0, table_width: int = 1) -> AttentionMetadata:
    """Metadata of a step: len(seq_lens) one-token sequences, then one prefill chunk if asked."""
    query_lens = [1] * len(seq_lens) + ([num_prefill_tokens] if num_prefill_tokens else [])
    num_seqs = len(query_lens)
    return AttentionMetadata(
        num_decodes=len(seq_lens), query_start_loc=torch.tensor([0, *query_lens]).cumsum(0).int(),
        seq_lens=torch.tensor(seq_lens + [num_prefill_tokens] * (num_prefill_tokens > 0), dtype=torch.int32),
        block_tables=torch.zeros(num_seqs, table_width, dtype=torch.int32),
        slot_mapping=torch.zeros(sum(query_lens), dtype=torch.int64),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens + [num_prefill_tokens]))


def test_bucket_is_the_smallest_captured_size_that_holds_a_pure_one_token_step():
    calls = []

    def forward(input_ids, positions, meta, logits_indices):
        calls.append((len(input_ids), meta.max_seq_len, meta.max_query_len))
        return torch.zeros(len(logits_indices), 5)
    graphs = DecodeGraphs(forward, SIZES, max_model_len=100, block_size=BLOCK_SIZE, device=torch.device("cpu"),
                          graph_type=EagerGraph)
    # captured largest first, each with the host maxima that hold any step up to max_model_len
    assert calls == [(8, 100, 1), (4, 100, 1), (2, 100, 1), (1, 100, 1)]
    assert [graphs.bucket_for(decode_meta([5] * n)) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    assert graphs.bucket_for(decode_meta([5] * 9)) is None                    # above the largest bucket
    assert graphs.bucket_for(decode_meta([5, 5], num_prefill_tokens=3)) is None  # a prefill chunk in the step
    assert graphs.bucket_for(decode_meta([101])) is None                      # past max_model_len
    assert graphs.bucket_for(decode_meta([5], table_width=8)) is None         # wider than 100 tokens of blocks
    assert graphs.bucket_for(decode_meta([100], table_width=7)) == 1


def new_request(req_id: str, context_len: int, block_ids: list[int], vocab_size: int) -> NewRequestData:
    """A request whose first context_len - 1 tokens are already in the cache: it decodes now."""
    rng = random.Random(req_id)
    tokens = [rng.randrange(3, vocab_size) for _ in range(context_len)]
    return NewRequestData(req_id, tokens, SamplingParams(temperature=0, logprobs=3), block_ids, context_len - 1)


def decode_step(num_seqs: int, vocab_size: int, prefix: str = "r") -> tuple[SchedulerOutput, list[int]]:
    """One pure decode step; request 0 owns block 0 (a pad row's block). Returns the step and
    the cache slots its tokens write."""
    blocks = torch.randperm(32, generator=torch.Generator().manual_seed(num_seqs)).tolist()
    blocks.remove(0)
    sched, slots = SchedulerOutput(), []
    for i in range(num_seqs):
        req_id, context_len = f"{prefix}{i}", 5 + 9 * i
        owned = ([0] if i == 0 else []) + [blocks.pop() for _ in range(4 - (i == 0))]
        sched.scheduled_new_reqs.append(new_request(req_id, context_len, owned, vocab_size))
        sched.num_scheduled_tokens[req_id] = 1
        pos = context_len - 1
        slots.append(owned[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
    sched.total_num_scheduled_tokens = num_seqs
    return sched, slots


def random_caches(loaded) -> list[torch.Tensor]:
    caches = allocate_kv_caches(32, loaded.arch, BLOCK_SIZE, torch.float32, torch.device("cpu"))
    return [c.normal_() for c in caches]


def assert_written_only(before: list[torch.Tensor], after: list[torch.Tensor], slots: list[int]) -> None:
    untouched = torch.ones(32 * BLOCK_SIZE, dtype=torch.bool)
    untouched[slots] = False
    for b, a in zip(before, after):  # [2, slots, kv_heads, head_dim] per layer
        assert torch.equal(a.flatten(1, 2)[:, untouched], b.flatten(1, 2)[:, untouched]), "a pad row wrote the cache"


def make_runner(loaded, kv_caches, graphs: bool, backend: str = "cpu") -> ModelRunner:
    executor = LocalExecutor(loaded)
    executor.start_kv(kv_caches[0].shape[1], kv_caches, get_attention_backend(backend))
    runner = ModelRunner(loaded.model, kv_caches, BLOCK_SIZE, executor.backend, torch.device("cpu"), executor=executor)
    if graphs:
        runner.capture_decode_graphs(SIZES, max_model_len=512, max_num_seqs=8, graph_type=EagerGraph)
    return runner


@pytest.mark.parametrize("num_seqs", [1, 3, 5])
def test_padded_step_equals_eager_and_writes_only_its_own_slots(loaded, num_seqs):
    torch.manual_seed(0)
    initial = random_caches(loaded)
    eager_caches, graph_caches = [c.clone() for c in initial], [c.clone() for c in initial]
    sched, slots = decode_step(num_seqs, loaded.arch.vocab_size)
    eager = make_runner(loaded, eager_caches, graphs=False).execute_model(sched)
    runner = make_runner(loaded, graph_caches, graphs=True)
    got = runner.execute_model(sched)
    replays = {size: graph.num_replays for size, graph in runner.decode_graphs.graphs.items()}
    bucket = {1: 1, 3: 4, 5: 8}[num_seqs]
    assert replays == {size: int(size == bucket) for size in SIZES}
    assert got.sampled_token_ids == eager.sampled_token_ids
    for req_id, [(logprob, top)] in eager.logprobs.items():
        assert got.logprobs[req_id][0][0] == pytest.approx(logprob, abs=1e-5)
        assert got.logprobs[req_id][0][1].keys() == top.keys()
    assert_written_only(initial, graph_caches, slots)
    for after, ref in zip(graph_caches, eager_caches):
        torch.testing.assert_close(after.flatten(1, 2)[:, slots], ref.flatten(1, 2)[:, slots], atol=1e-5, rtol=1e-5)


def test_rows_a_larger_step_left_behind_become_padding(loaded):
    """Rows 5 and 6 of bucket 8 held real requests a step ago; their blocks have been reused
    since (new random contents). The next 5-request step must not write those old slots."""
    torch.manual_seed(0)
    caches = random_caches(loaded)
    runner = make_runner(loaded, caches, graphs=True)
    first, _ = decode_step(7, loaded.arch.vocab_size)
    runner.execute_model(first)
    for cache in caches:
        cache.normal_()
    before = [c.clone() for c in caches]
    second, slots = decode_step(5, loaded.arch.vocab_size, prefix="s")
    second.finished_req_ids = set(first.num_scheduled_tokens)
    runner.execute_model(second)
    assert runner.decode_graphs.graphs[8].num_replays == 2
    assert_written_only(before, caches, slots)


def run_engine(loaded, model_dir: str, graphs: bool, prompts: list[list[int]], max_tokens: list[int],
               backend: str = "cpu", **scheduler) -> tuple[list[list[int]], list[tuple[int, int, bool]]]:
    """Half the requests first, the rest joining one per step while those decode; each stops at
    its own length. Returns the tokens and, per step, (requests, sampled rows, ran in a graph)."""
    config = EngineConfig(model=model_dir, attention_backend=backend, scheduler=SchedulerConfig(**scheduler))
    engine = EngineCore(config, progress=False, loaded=loaded)
    steps: list[tuple[int, int, bool]] = []
    if graphs:
        engine.runner.capture_decode_graphs(SIZES, engine.max_model_len, engine.scheduler.config.max_num_seqs,
                                            graph_type=EagerGraph)
        decode_graphs = engine.runner.decode_graphs
        run = decode_graphs.run

        def spy(batch):
            logits = run(batch)
            steps.append((batch.meta.num_seqs, len(batch.logits_indices), logits is not None))
            return logits
        decode_graphs.run = spy
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    waiting, results = list(range(len(prompts))), {}
    for i in waiting[:len(prompts) // 2]:
        engine.add_request(EngineRequest(f"r{i}", prompts[i], params[i]))
    waiting, num_steps = waiting[len(prompts) // 2:], 0
    while waiting or engine.has_unfinished_requests():
        if waiting and (num_steps % 3 == 2 or not engine.has_unfinished_requests()):
            i = waiting.pop(0)
            engine.add_request(EngineRequest(f"r{i}", prompts[i], params[i]))
        results.update((out.req_id, out.token_ids) for out in engine.step() if out.finished)
        num_steps += 1
    return [results[f"r{i}"] for i in range(len(prompts))], steps


def workload(vocab_size: int, num_prompts: int, max_prompt_len: int, max_output: int, seed: int = 0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab_size) for _ in range(rng.randint(1, max_prompt_len))]
               for _ in range(num_prompts)]
    return prompts, [rng.randint(1, max_output) for _ in range(num_prompts)]


@pytest.mark.parametrize("scheduler", [
    dict(long_prefill_token_threshold=16, max_num_batched_tokens=48),  # prefill chunks beside decodes
    dict(long_prefill_token_threshold=1),  # prompts one token a step: graphs run prefill tokens too
])
def test_engine_tokens_with_graphs_equal_eager(loaded, tiny_llama_dir, scheduler):
    prompts, max_tokens = workload(loaded.arch.vocab_size, 16, 40, 40)
    eager, _ = run_engine(loaded, tiny_llama_dir, False, prompts, max_tokens, **scheduler)
    got, steps = run_engine(loaded, tiny_llama_dir, True, prompts, max_tokens, **scheduler)
    assert got == eager
    assert [len(t) for t in got] == max_tokens
    in_graph = {n for n, _, graph in steps if graph}
    assert {1, 2} <= in_graph and in_graph - set(SIZES), "expected exact and padded buckets"
    assert any(not graph and n > 8 for n, _, graph in steps), "batches above the largest bucket run eagerly"
    if scheduler["long_prefill_token_threshold"] == 1:  # steps where a mid-prompt token is not sampled
        assert any(graph and sampled < n for n, sampled, graph in steps)


def test_triton_graphs_with_split_kv_equal_eager(loaded, tiny_llama_dir):
    """The triton backend (interpreter): graphs run the decode kernel with max_seq_len =
    max_model_len, three split-KV partitions and a reduction; eager steps of these short
    contexts run one partition. Same tokens."""
    prompts, max_tokens = workload(loaded.arch.vocab_size, 6, 12, 6, seed=1)
    eager, _ = run_engine(loaded, tiny_llama_dir, False, prompts, max_tokens, "triton", max_model_len=1100)
    got, steps = run_engine(loaded, tiny_llama_dir, True, prompts, max_tokens, "triton", max_model_len=1100)
    assert got == eager
    assert any(graph and n not in SIZES for n, _, graph in steps)  # a padded bucket
