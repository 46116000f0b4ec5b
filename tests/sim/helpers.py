"""A hand-made profile with round numbers, so expected times are simple sums."""
from pdserve.sim.profile import Profile, SchedulerLimits, Table1D

# prefill: 10 ms + 0.1 ms per token; decode: 20 ms + 1 ms per sequence (context-free);
# KV: 1 ms + 1 ms per MB each way; 1000 bytes per token
PREFILL = Table1D((0.0, 10000.0), (0.010, 0.010 + 10000 * 1e-4))
DECODE_S = ((0.021, 0.021), (0.084, 0.084))


def flat_profile(**limits) -> Profile:
    return Profile("hand-written from published numbers: test values", "test", PREFILL, (1, 64), (16, 4096),
                   DECODE_S, Table1D((0.0, 1e6), (0.001, 0.002)), Table1D((0.0, 1e6), (0.001, 0.002)), 1000,
                   SchedulerLimits(**limits))
