"""What this engine's steps measure to cost, for a router deciding where work goes.

A step's time is roughly a decode part (one pass over the weights for the running batch)
plus the prompt tokens it prefills at the engine's prefill rate:

    step_s ~= decode_step_s + prefill_tokens / prefill_tokens_per_s

Pure decode steps measure the first term directly; steps that prefill enough tokens to
dominate measure the rate from what remains. Both are exponentially weighted averages of
recent steps, so they follow the hardware, the batch and the contexts as they change,
without configuration. Zero means "not measured yet".
"""
from __future__ import annotations

from dataclasses import dataclass

# weight of the newest step: ~10 steps of memory, so a burst moves the estimate within a second or two
_ALPHA = 0.2
# below this many prompt tokens a step's time is mostly its decode part: too noisy for the rate
# (a step without decodes measures it whatever its size)
MIN_PREFILL_TOKENS_FOR_RATE = 32


@dataclass
class StepRates:
    decode_step_s: float = 0.0
    prefill_tokens_per_s: float = 0.0

    def observe(self, num_prefill_tokens: int, num_decodes: int, seconds: float) -> None:
        """One executed step: how many prompt tokens it computed, how many sequences it
        decoded, how long it took."""
        if seconds <= 0:
            return
        if num_prefill_tokens == 0:
            if num_decodes:
                self.decode_step_s = _ewma(self.decode_step_s, seconds)
            return
        if num_decodes and num_prefill_tokens < MIN_PREFILL_TOKENS_FOR_RATE:
            return  # (without decodes the whole step is prefill, however small: a time-bounded step's)
        decode_part = self.decode_step_s if num_decodes else 0.0
        # never credit the prefill with less than half the step: a slow step is not a fast prefill
        prefill_s = max(seconds - decode_part, seconds / 2)
        self.prefill_tokens_per_s = _ewma(self.prefill_tokens_per_s, num_prefill_tokens / prefill_s)

    def prefill_tokens_within(self, step_s: float, with_decodes: bool) -> int:
        """Prompt tokens a step can compute and still last at most `step_s`, beside a decode
        batch or not; 0 while the prefill rate is not measured."""
        decode_part = self.decode_step_s if with_decodes else 0.0
        return int(max(0.0, step_s - decode_part) * self.prefill_tokens_per_s)


def _ewma(current: float, sample: float) -> float:
    return sample if current == 0.0 else (1 - _ALPHA) * current + _ALPHA * sample
