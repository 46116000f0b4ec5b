"""`pdserve profile`: measure a Profile (sim/profile.py) on the machine at hand, with the
real engine (EngineCore.step, as a worker runs it) and a real kvstore (the client's
put_blocks / get_blocks, as the prefill and decode workers move KV):

    prefill   one step computing T prompt tokens (T/threshold prompts, each one chunk)
    decode    steps where B sequences of context C all decode, nothing prefills
    kv        put_blocks then get_blocks of N blocks of the model's KV shape

Each point is a median: of `--repeats` rounds over the prefill grid, of 4 x `--repeats`
decode steps, of `--repeats` transfers. The prefill and decode tables are then smoothed by a
fit of each one's cost model (profiler/fit.py): this VM's speed drifts by tens
of percent within minutes, and a median of a few samples still lands up to 25% off the
curve its neighbours draw. The grids are flags; the defaults take a couple of
minutes for SmolLM2 on one CPU core (a `pdserve up` worker's share here).
"""
from __future__ import annotations

import argparse
import math
import os
import socket
import statistics
import time

from pdserve.engine.engine_request import EngineRequest
from pdserve.profiler.fit import fit_decode, fit_prefill
from pdserve.profiler.kv_probe import kv_tables
from pdserve.sim.profile import Profile, SchedulerLimits, Table1D, save_profile


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(sorted({int(v) for v in text.split(",") if v.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    from pdserve.engine.config import DEFAULT_MODEL
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--out", required=True, help="the profile JSON to write")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (a worker's --threads)")
    p.add_argument("--prefill-tokens", type=_ints, default=(16, 64, 256, 512, 1024, 2048))
    p.add_argument("--batch-sizes", type=_ints, default=(1, 4, 16, 32))
    p.add_argument("--contexts", type=_ints, default=(32, 256, 1024))
    p.add_argument("--kv-blocks", type=_ints, default=(1, 4, 16, 64))
    p.add_argument("--repeats", type=int, default=3)


def run(args) -> int:
    if args.threads < 1:
        raise ValueError(f"--threads: must be >= 1, got {args.threads}")
    if args.repeats < 1:
        raise ValueError(f"--repeats: must be >= 1, got {args.repeats}")
    profile = measure(args.model, args.threads, args.prefill_tokens, args.batch_sizes, args.contexts,
                      args.kv_blocks, args.repeats)
    save_profile(profile, args.out)
    print(f"wrote {args.out} ({profile.source})")
    return 0


def measure(model: str, threads: int, prefill_tokens, batch_sizes, contexts, kv_blocks, repeats: int) -> Profile:
    import torch
    from pdserve.engine import LLM
    torch.set_num_threads(threads)
    engine = LLM(model, progress=False).engine
    sched = engine.scheduler.config
    limits = SchedulerLimits(sched.max_num_seqs, sched.max_num_batched_tokens, sched.long_prefill_token_threshold,
                             engine.kv_manager.block_size, engine.kv_manager.pool.num_blocks)
    ids = _Prompts(engine.info.vocab_size)
    _prefill_step(engine, ids, 64, limits)  # untimed: first calls pay one-off costs
    _decode_step(engine, ids, 2, 32, 1)
    # the repeats go round the grid rather than point by point: this VM's speed drifts by
    # tens of percent over minutes, and a slow minute spread over every point keeps the
    # curve's shape (each prompt's own attention) where it would bend one point
    samples = {t: [] for t in prefill_tokens}
    for _ in range(repeats):
        for t in prefill_tokens:
            samples[t].append(_prefill_step(engine, ids, t, limits))
    prefill_s, prefill_worst = fit_prefill(prefill_tokens, [statistics.median(samples[t]) for t in prefill_tokens],
                                           limits.long_prefill_token_threshold)
    prefill = Table1D(tuple(map(float, prefill_tokens)), prefill_s)
    decode, worst = fit_decode(batch_sizes, contexts,
                               [[_decode_step(engine, ids, b, c, repeats) for c in contexts] for b in batch_sizes])
    block_shape = engine.info.kv_block_shape
    element = torch.empty((), dtype=engine.dtype).element_size()
    put, get = kv_tables(block_shape, engine.dtype, kv_blocks, repeats)
    per_token = element * math.prod(block_shape) // limits.block_size
    # on a CPU the transfer's gRPC and copies run on the worker's own cores; on a GPU the
    # steps run on the device and the host threads that move the bytes do not slow them
    kv_cpu_share = 1.0 if engine.config.device.startswith("cpu") else 0.0
    return Profile(source=f"measured on {socket.gethostname()} ({os.cpu_count()} CPUs, {threads} torch thread(s), "
                          f"{time.strftime('%Y-%m-%d %H:%M')}, load average {os.getloadavg()[0]:.2f}; fitted "
                          f"to the medians: prefill within {prefill_worst:.0%}, decode within {worst:.0%})",
                   model=model, prefill=prefill, decode_batch_sizes=tuple(batch_sizes),
                   decode_contexts=tuple(contexts), decode_s=decode, kv_put=put, kv_get=get,
                   kv_bytes_per_token=per_token, scheduler=limits, kv_cpu_share=kv_cpu_share)


class _Prompts:
    """Distinct random prompts (no prefix-cache hits between measurements)."""

    def __init__(self, vocab_size: int):
        import random
        self.rng, self.vocab, self.n = random.Random(0), vocab_size, 0

    def take(self, num_tokens: int) -> list[int]:
        return [self.rng.randrange(100, self.vocab) for _ in range(num_tokens)]

    def req_id(self) -> str:
        self.n += 1
        return f"profile-{self.n}"


def _prefill_step(engine, ids: _Prompts, num_tokens: int, limits: SchedulerLimits) -> float:
    """One step that computes `num_tokens` prompt tokens (each prompt one chunk)."""
    from pdserve.engine import SamplingParams
    n = -(-num_tokens // limits.long_prefill_token_threshold)
    sizes = [num_tokens // n + (1 if i < num_tokens % n else 0) for i in range(n)]
    req_ids = [ids.req_id() for _ in sizes]
    for req_id, size in zip(req_ids, sizes):
        engine.add_request(EngineRequest(req_id, ids.take(size), SamplingParams(max_tokens=1, ignore_eos=True)))
    start = time.perf_counter()
    engine.step()
    seconds = time.perf_counter() - start
    _drain(engine, req_ids)
    return seconds


def _decode_step(engine, ids: _Prompts, batch: int, context: int, repeats: int) -> float:
    """Median time of steps where `batch` sequences of about `context` tokens decode (four
    steps a repeat: they are cheap next to the prefill that sets them up)."""
    from pdserve.engine import SamplingParams
    num_steps = 4 * repeats
    req_ids = [ids.req_id() for _ in range(batch)]
    for req_id in req_ids:
        engine.add_request(EngineRequest(req_id, ids.take(context),
                                         SamplingParams(max_tokens=num_steps + 64, ignore_eos=True)))
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                          for r in engine.scheduler.running):
        engine.step()
    times = []
    for _ in range(num_steps + 1):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    _drain(engine, req_ids)
    return statistics.median(times[1:])  # the first may still hold the last prefill's sampling


def _drain(engine, req_ids) -> None:
    for req_id in req_ids:
        engine.abort_request(req_id)
    while engine.has_unfinished_requests():
        engine.step()
