"""choose_slot, the one slot rule of the live pool and the simulator: saturated workers are
skipped, the policy picks among the rest, and only the prompt tokens the worker will
compute count as reserved on it."""
from __future__ import annotations

from pdserve.services.router.decide.config import SaturationConfig
from pdserve.services.router.decide.policy import LEAST_LOADED, LeastQueuedPrefill, Placement, WorkerPolicy
from pdserve.services.router.decide.saturation import SaturationPolicy
from pdserve.services.router.decide.slots import SlotChoice, choose_slot
from pdserve.services.router.decide.views import NoPrefixes, PrefixMatch, WorkerView

SATURATION = SaturationPolicy(SaturationConfig(max_waiting=4))


def _up(address: str, **load) -> WorkerView:
    return WorkerView(address, True, **load)


class _Reuses(WorkerPolicy):
    """The first candidate, expected to reuse `num_cached_tokens` of the prompt."""

    def __init__(self, num_cached_tokens: int):
        self.num_cached_tokens = num_cached_tokens
        self.seen: list[str] = []

    def choose(self, candidates, prompt_token_ids):
        return candidates[0] if candidates else None

    def place(self, candidates, prompt_token_ids):
        self.seen = [w.address for w in candidates]
        worker = self.choose(candidates, prompt_token_ids)
        return None if worker is None else Placement(worker, LEAST_LOADED, self.num_cached_tokens)


def test_the_policy_chooses_among_the_unsaturated_workers_only():
    policy = _Reuses(0)
    up = [_up("a", num_waiting=4), _up("b"), _up("c", num_waiting=3)]
    assert choose_slot(up, SATURATION, policy, [1, 2, 3], 3) == SlotChoice("b", 3)
    assert policy.seen == ["b", "c"]


def test_every_worker_saturated_is_no_slot():
    up = [_up("a", num_waiting=9), _up("b", draining=True)]
    assert choose_slot(up, SATURATION, LeastQueuedPrefill(), [1, 2], 2) is None
    assert choose_slot([], SATURATION, LeastQueuedPrefill(), [1, 2], 2) is None


def test_only_the_tokens_the_worker_computes_are_reserved():
    assert choose_slot([_up("a")], SATURATION, _Reuses(48), list(range(64)), 64) == SlotChoice("a", 16)
    # a decode after a prefill computes nothing, whatever its cache holds
    assert choose_slot([_up("a")], SATURATION, _Reuses(48), list(range(64)), 0) == SlotChoice("a", 0)
    assert choose_slot([_up("a")], SATURATION, _Reuses(80), list(range(64)), 64) == SlotChoice("a", 0)


def test_least_queued_prefill_picks_the_smallest_backlog_counting_this_routers_own():
    up = [_up("a", num_queued_prefill_tokens=100), _up("b", in_flight_tokens=50), _up("c", num_queued_prefill_tokens=70)]
    assert choose_slot(up, SATURATION, LeastQueuedPrefill(), [1], 1) == SlotChoice("b", 1)


def test_no_prefixes_reports_nothing_held():
    from pdserve.services.router.decide.views import NoPrefixes, PrefixMatch
    assert NoPrefixes().match(["a", "b"], [1, 2, 3], store="s") == PrefixMatch({"a": 0, "b": 0}, 0)
