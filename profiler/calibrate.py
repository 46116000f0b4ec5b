"""Bring a profile to the machine as it runs now, from a probe of the idle platform.

A profile is measured once; on a shared VM the same step then runs up to 50% slower or
faster an hour later (SmolLM2's one-sequence decode step: 89 to 135 ms over five
profiles of one day). A probe of a few lone requests on the started platform measures
where the speed stands, and what a request and a hand-off cost beyond the engine:

    decode factor    median gap between tokens  /  profile's decode step (1 sequence)
    prefill factor   TTFT(long) - TTFT(short)   /  profile's prefill(long) - prefill(short)
    request          TTFT(short) - prefill factor x prefill(short)
    KV factor        first gap(long) - first gap(short)  /  profile's put + get, long - short
    hand-off         first gap(short) - gap - KV factor x KV read   (0 colocated: no hand-off)

On the disaggregated platform a second probe (`NeighbourProbe`) keeps both workers busy at
once: streams decoding on the decode worker while prompts prefill on the prefill worker.

    neighbour decode factor    gap beside a prefill  /  gap of the same streams before it
    neighbour prefill factor   TTFT beside the streams  /  the lone TTFT (request overhead off both)

The factors take in what a serving worker's step costs beyond `engine.step()`, so the
calibrated profile's `step_overhead_s` is 0. Nothing here sees the workload.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from pdserve.sim.profile import Profile


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
    first_gap_long_s: float = 0.0   # the same for the long prompts (0: not measured)


@dataclass(frozen=True)
class NeighbourProbe:
    """Medians over streams decoding while long prompts prefill on the other worker."""
    gap_alone_s: float          # the streams' gaps before the prompts were sent
    gap_beside_prefill_s: float  # their gaps while a prompt prefilled
    ttft_beside_decode_s: float  # the prompts' TTFT (of ProbeResult.long_tokens each)


@dataclass(frozen=True)
class Calibration:
    prefill_factor: float
    decode_factor: float
    request_overhead_s: float
    handoff_overhead_s: float
    kv_factor: float = 1.0
    neighbour_prefill_factor: float = 1.0
    neighbour_decode_factor: float = 1.0

    def apply(self, profile: Profile) -> Profile:
        return replace(profile.scaled(self.prefill_factor, self.decode_factor, self.kv_factor),
                       request_overhead_s=self.request_overhead_s, step_overhead_s=0.0,
                       handoff_overhead_s=self.handoff_overhead_s,
                       neighbour_prefill_factor=self.neighbour_prefill_factor,
                       neighbour_decode_factor=self.neighbour_decode_factor)


def calibrate(profile: Profile, probe: ProbeResult, disaggregated: bool,
              neighbours: NeighbourProbe | None = None) -> Calibration:
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
    handoff, kv = 0.0, 1.0
    if disaggregated:
        if probe.first_gap_long_s:
            modelled_kv = profile.handoff_s(probe.long_tokens) - profile.handoff_s(probe.short_tokens)
            kv = max(probe.first_gap_long_s - probe.first_gap_s, 0.0) / modelled_kv if modelled_kv > 0 else 1.0
            if not kv > 0:
                raise ValueError(f"probe: the {probe.long_tokens}-token prompts' first gap "
                                 f"({probe.first_gap_long_s:.3f} s) must exceed the {probe.short_tokens}-token "
                                 f"ones' ({probe.first_gap_s:.3f} s): a longer prompt's KV takes longer to move")
        read = kv * profile.kv_get(probe.short_tokens * profile.kv_bytes_per_token)
        handoff = max(0.0, probe.first_gap_s - probe.gap_s - read)
    neighbour_prefill = neighbour_decode = 1.0
    if neighbours is not None:
        for name in ("gap_alone_s", "gap_beside_prefill_s", "ttft_beside_decode_s"):
            if not getattr(neighbours, name) > 0:
                raise ValueError(f"neighbour probe: field '{name}' must be > 0, got {getattr(neighbours, name)}")
        # a neighbour slows a step down or leaves it be: a ratio under 1 is this VM's noise
        neighbour_decode = max(1.0, neighbours.gap_beside_prefill_s / neighbours.gap_alone_s)
        neighbour_prefill = max(1.0, (neighbours.ttft_beside_decode_s - request) / (probe.ttft_long_s - request))
    return Calibration(prefill, decode, request, handoff, kv, neighbour_prefill, neighbour_decode)
