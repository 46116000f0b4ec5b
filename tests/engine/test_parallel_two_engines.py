"""Each parallel engine owns its groups (engine/executor/rank_group.py): a TP engine and a
PP engine started one after the other in one process both give the single-rank tokens,
and shutting one down leaves the other working; torch.distributed's one default group per
process is never joined, which is what made the second engine fail before."""
from __future__ import annotations

import datetime
import threading
import time

import torch
import torch.distributed as dist

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.executor.rank_group import RankGroup

TIMEOUT = datetime.timedelta(seconds=20)
ENGINE_KW = dict(kv_cache_memory_bytes=1 << 24, collective_timeout_s=30, progress=False)
PROMPTS = [[3, 14, 15, 92, 65], [35, 89, 79, 32, 38, 46, 26, 43]]


def _on_ranks(store: dist.Store, name: str, size: int, body) -> list:
    """`body(group, rank)` on each rank of a gloo group, one thread a rank (gloo works
    across threads of one process): what each rank returned, in rank order."""
    results: list = [None] * size
    errors: list[BaseException] = []

    def rank_thread(rank: int) -> None:
        try:
            group = RankGroup.open(store, name, rank, size, "gloo", TIMEOUT)
            results[rank] = body(group, rank)
        except BaseException as e:  # noqa: BLE001 - handed to the test's thread below
            errors.append(e)

    threads = [threading.Thread(target=rank_thread, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=TIMEOUT.total_seconds())
    if errors:
        raise errors[0]
    return results


def test_a_rank_group_runs_every_op_the_executor_makes():
    def ops(group: RankGroup, rank: int):
        summed = group.all_reduce(torch.tensor([rank + 1.0]))
        gathered = group.all_gather(torch.tensor([10.0 * rank]))
        sent = torch.tensor([rank + 7.0])
        group.broadcast(sent, src=1)
        received = None
        if rank == 0:
            received = torch.empty(1)
            group.recv(received, src=2)
        elif rank == 2:
            group.isend(torch.tensor([42.0]), dst=0).wait()
        group.barrier()
        return summed.item(), [g.item() for g in gathered], sent.item(), received

    results = _on_ranks(dist.HashStore(), "g", 3, ops)
    assert [r[:3] for r in results] == [(6.0, [0.0, 10.0, 20.0], 8.0)] * 3
    assert results[0][3].tolist() == [42.0]
    assert not dist.is_initialized()  # no default group was needed


def test_closing_one_engines_group_leaves_anothers_working():
    """Two groups of one name, on two stores as two engines' rendezvous are."""
    first = _on_ranks(dist.HashStore(), "device", 2, lambda g, r: g)
    second_store = dist.HashStore()
    for group in first:
        group.close()
    assert _on_ranks(second_store, "device", 2, lambda g, r: g.all_reduce(torch.tensor([r + 1.0])).item()) == [3.0, 3.0]


def _tokens(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=6)
    return [o.token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]


def test_a_tp_engine_then_a_pp_engine_in_one_process(tiny, tiny_llama_dir):
    """The issue's script: the second engine started while the first still runs used to
    fail with 'trying to initialize the default process group twice!'."""
    expected = _tokens(LLM(tiny_llama_dir, loaded_model=tiny, **ENGINE_KW))
    tp = LLM(tiny_llama_dir, tensor_parallel_size=2, **ENGINE_KW)
    try:
        assert _tokens(tp) == expected
        start = time.monotonic()
        pp = LLM(tiny_llama_dir, pipeline_parallel_size=2, **ENGINE_KW)
        try:
            assert _tokens(pp) == expected
            assert _tokens(tp) == expected  # the two take turns in one process
        finally:
            pp.engine.shutdown()
        assert time.monotonic() - start < ENGINE_KW["collective_timeout_s"]  # no collective waited out
        assert _tokens(tp) == expected  # the first outlives the second's shutdown
        assert not dist.is_initialized()
    finally:
        tp.engine.shutdown()
