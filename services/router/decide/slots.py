"""Which worker of a pool takes a request, and how many prompt tokens count as outstanding
on it. One rule for the live pool (core/pools.py, which then reserves them in the
registry) and the simulator (sim/router.py, which adds them to its own views)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.services.router.decide.policy import WorkerPolicy
from pdserve.services.router.decide.saturation import SaturationPolicy
from pdserve.services.router.decide.views import WorkerView


@dataclass(frozen=True)
class SlotChoice:
    address: str
    # what the worker will compute: the prompt tokens it does not reuse from a cached prefix
    num_reserved_tokens: int


def choose_slot(up: Sequence[WorkerView], saturation: SaturationPolicy, policy: WorkerPolicy,
                prompt_token_ids: Sequence[int], num_prefill_tokens: int) -> SlotChoice | None:
    """The policy's choice among the `up` workers that are not saturated; None when every
    one is (the request waits in the admission queue)."""
    chosen = policy.place([w for w in up if not saturation.is_saturated(w)], prompt_token_ids)
    if chosen is None:
        return None
    return SlotChoice(chosen.worker.address, max(0, num_prefill_tokens - chosen.num_cached_tokens))
