"""Bring a profile to the machine as it runs now, from a probe of the idle platform.

A profile is measured once; on a shared VM the same step then runs up to 50% slower or
faster an hour later (SmolLM2's one-sequence decode step: 89 to 135 ms over five
profiles of one day). A probe of a few lone requests on the started platform measures
where the speed stands, and what a request and a hand-off cost beyond the engine:

    decode factor    median gap between tokens  /  profile's decode step (1 sequence)
    prefill factor   TTFT(long) - TTFT(short)   /  profile's prefill(long) - prefill(short)
    request          TTFT(short) - prefill factor x prefill(short)
    hand-off         first gap - gap - KV read      (0 on the colocated path: no hand-off)

The factors take in what a serving worker's step costs beyond `engine.step()`, so the
calibrated profile's `step_overhead_s` is 0. Nothing here sees the workload.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from sim.profile import Profile


@dataclass(frozen=True)
class ProbeResult:
    """Medians over the probe's lone requests."""
    short_tokens: int
    long_tokens: int
    ttft_short_s: float
    ttft_long_s: float
    gap_s: float            # between tokens, after the second
    first_gap_s: float      # first to second token: the hand-off on the disaggregated path
    gap_context: float      # the context the gaps decoded at, on average


@dataclass(frozen=True)
class Calibration:
    prefill_factor: float
    decode_factor: float
    request_overhead_s: float
    handoff_overhead_s: float

    def apply(self, profile: Profile) -> Profile:
        return replace(profile.scaled(self.prefill_factor, self.decode_factor),
                       request_overhead_s=self.request_overhead_s, step_overhead_s=0.0,
                       handoff_overhead_s=self.handoff_overhead_s)


def calibrate(profile: Profile, probe: ProbeResult, disaggregated: bool) -> Calibration:
    if not probe.long_tokens > probe.short_tokens:
        raise ValueError(f"probe: long_tokens ({probe.long_tokens}) must exceed short_tokens ({probe.short_tokens})")
    modelled = profile.prefill_s(probe.long_tokens) - profile.prefill_s(probe.short_tokens)
    seen = probe.ttft_long_s - probe.ttft_short_s
    if not (modelled > 0 and seen > 0):
        raise ValueError(f"probe: a {probe.long_tokens}-token prompt's TTFT ({probe.ttft_long_s:.3f} s) must exceed "
                         f"a {probe.short_tokens}-token one's ({probe.ttft_short_s:.3f} s), in the profile too")
    prefill = seen / modelled
    decode = probe.gap_s / profile.decode_step_s(1, probe.gap_context)
    request = max(0.0, probe.ttft_short_s - prefill * profile.prefill_s(probe.short_tokens))
    handoff = 0.0
    if disaggregated:
        read = profile.kv_get(probe.short_tokens * profile.kv_bytes_per_token)
        handoff = max(0.0, probe.first_gap_s - probe.gap_s - read)
    return Calibration(prefill, decode, request, handoff)
