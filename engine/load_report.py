"""EngineCore.stats(): the engine's load as the scheduler, the KV cache manager, the step
rates and the drafter hold it, read between steps into one EngineStats (engine/stats.py)."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from pdserve.engine.core.tpot_room import tpot_stall_room_s
from pdserve.engine.stats import EngineStats, HostTierStats, SpecDecodeStats

if TYPE_CHECKING:
    from pdserve.engine.core.scheduler import Scheduler
    from pdserve.engine.step_rates import StepRates


def engine_stats(scheduler: Scheduler, step_rates: StepRates, num_compiling: int, spec: SpecDecodeStats,
                 max_model_len: int) -> EngineStats:
    """`num_compiling`: requests waiting for their grammar, counted as waiting."""
    kv = scheduler.kv
    return EngineStats(
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting) + num_compiling,
        num_queued_prefill_tokens=scheduler.num_queued_prefill_tokens(),
        num_free_kv_blocks=kv.num_free_blocks, num_total_kv_blocks=kv.pool.num_blocks,
        num_preemptions=scheduler.num_preemptions, num_prefix_queried_tokens=kv.num_queried_tokens,
        num_prefix_hit_tokens=kv.num_hit_tokens,
        host=HostTierStats(kv.num_host_queried_tokens, kv.num_host_hit_tokens, kv.host.num_offloaded_blocks,
                           kv.host.num_onloaded_blocks, kv.host.num_used_slots, kv.host.num_slots),
        prefill_tokens_per_s=step_rates.prefill_tokens_per_s,
        decode_step_ms=step_rates.decode_step_s * 1000,
        queued_prefill=scheduler.queued_prefill(), max_step_ms=scheduler.step_ms(),
        tpot_stall_room_ms=1000 * tpot_stall_room_s(scheduler.running, time.monotonic(),
                                                    step_rates.decode_step_s, max_model_len),
        spec=spec)
