"""In what order a step takes its prefill work (SchedulerConfig.scheduling_policy).

    fcfs  vLLM's order: running requests first, in admission order (decodes and prefill
          chunks alike), then the waiting queue (by priority, then arrival)
    srpt  decodes first; then every prefill, running (partly computed) or waiting, by
          priority, then by rank: the prompt tokens it still needs, minus the prompt tokens
          this engine has computed for others since it arrived (aging)

The work clock is the prompt tokens the scheduler has scheduled since start (time at the
measured prefill rate, while it is busy; deterministic in tests). Each request keeps an
aging origin: the clock when it arrived, moved on by each chunk of its own. So

    rank = still needed - (clock - aging origin)
         = still needed - prompt work done for OTHER requests since it arrived

A short prompt that arrives behind a long one ranks first and joins the next step. Every
token computed, for anyone, lowers a queued request's rank by one (its own as it needs
one less, another's as aging), so two queued requests never swap places: the order is
settled when the later one arrives (prefix hits found at admission aside), and whatever
arrives once R prompt tokens have been computed since a request of R tokens arrived ranks
behind it. The starvation bound that follows (docs/architecture.md, "Prefill order"): it
waits only for Q, the work queued before it that ranked lower, and A, the work of its
class that arrives while the engine computes R tokens, so it finishes within
ceil((Q + R + A) / F) steps of F prompt tokens, plus whatever work of a more urgent class
arrives meanwhile: between classes the order is strict (as the waiting queue's always
was).

A request may carry a deadline (a prefill worker's, from the router: the time left to its
class's TTFT target). In clock units, at the measured prefill rate, less the step in flight
it arrived behind: its budget B of prompt work until its first token is due. If its
length R fits (R <= B) it ranks by

    rank = min(still needed - computed for others since,  B - R - computed for anyone since)

the second term being the prompt work that may still go before it with its own R computed
after in time. A newcomer then overtakes it only while it would still meet its deadline
started from scratch, so a prompt that needs under half its budget orders as before, and a
longer one is overtaken by B - R tokens, not R. Both terms fall by one for every token
computed, so the order stays settled at arrival. A request whose deadline can no longer be
met (B - R - computed for anyone since + its own computed < 0), or never could (B < R), is
late: it ranks by length with a slower aging,

    rank = still needed - (computed for others since) / LATE_AGING_DIVISOR

so a lost first token takes no place from one that can still be on time until its request
has waited LATE_AGING_DIVISOR times its length of others' work; then nothing overtakes
it, which bounds its wait as above with that much more work. Being late is for good: the
slack B - R - computed for anyone since + own computed only falls. Late requests yield to
on-time ones, and among themselves go by that rank.
Pure Python: no torch.
"""
from __future__ import annotations

import bisect
from abc import ABC, abstractmethod
from collections.abc import Iterable

from pdserve.engine.config import SCHEDULING_POLICIES  # noqa: F401  (the choices, beside the policies they name)
from pdserve.engine.request import Request
from pdserve.engine.stats import QueuedPrefill
from pdserve.engine.step_rates import StepRates


def num_prefill_needed(request: Request) -> int:
    """Prompt (and, after a preemption, output) tokens still to compute, as far as is known
    before admission: imported KV counts as computed, prefix-cache hits are found later."""
    imported = request.kv_import.num_tokens if request.kv_import is not None else 0
    return request.num_tokens - max(request.num_computed_tokens, imported)


def is_decode(request: Request) -> bool:
    """One token to compute: a decode (or a prompt's last token, the same thing for a step)."""
    return request.num_tokens - request.num_computed_tokens == 1


class PrefillOrder(ABC):
    name: str

    @abstractmethod
    def runs_first(self, request: Request) -> bool:
        """Whether a running request is scheduled in the first pass, in admission order."""

    @abstractmethod
    def order(self, running: Iterable[Request], waiting: Iterable[Request], clock: int) -> list[Request]:
        """The prefill candidates in the order the step takes them: the running requests the
        first pass left (`running`) and the waiting queue."""

    @abstractmethod
    def rank(self, request: Request, clock: int) -> int:
        """How a queued request compares with a new one of the same priority that needs n
        prompt tokens: it goes first when rank <= n. The worker reports ranks to the router."""

    def on_arrival(self, request: Request, clock: int, rates: StepRates, max_step_ms: float) -> None:
        """What the order keeps of a request as it is queued (nothing, unless it says)."""


class FirstComeFirstServed(PrefillOrder):
    name = "fcfs"

    def runs_first(self, request):
        return True

    def order(self, running, waiting, clock):
        return [*running, *waiting]

    def rank(self, request, clock):
        return 0  # everything queued goes before a newcomer of the same priority


class ShortestRemainingFirst(PrefillOrder):
    """Priority, then rank (see the module's docstring); ties keep admission, then queue order."""
    name = "srpt"

    def runs_first(self, request):
        return is_decode(request)

    def order(self, running, waiting, clock):
        return sorted([*running, *waiting], key=lambda r: (r.priority, self.rank(r, clock)))

    def on_arrival(self, request, clock, rates, max_step_ms):
        keep_deadline(request, clock, rates, max_step_ms)

    def rank(self, request, clock):
        needed = num_prefill_needed(request)
        for_others = clock - request.clocks.aging
        if request.clocks.deadline is None:
            return needed - for_others  # no deadline: by length
        if request.clocks.deadline - clock < needed:  # lost: it yields to those still on time
            return needed - for_others // LATE_AGING_DIVISOR
        return min(needed - for_others, request.clocks.latest_start - clock)


def deadline_tokens(ttft_budget_s: float, tokens_per_s: float, max_step_ms: float) -> int | None:
    """A TTFT budget as prompt work: what the prefill rate computes in it, less the step in
    flight it arrives behind (below the prompt's own tokens, or 0: it cannot be on time).
    None when there is none to keep: no budget, or no measured rate."""
    if ttft_budget_s <= 0 or tokens_per_s <= 0:
        return None
    return max(0, int((ttft_budget_s - max_step_ms / 1000) * tokens_per_s))


def rank_on_arrival(num_tokens: int, ttft_budget_s: float, tokens_per_s: float, max_step_ms: float) -> int:
    """A newcomer's srpt rank: its length, or less under a deadline that leaves under as
    much again for others (never below 1: ties go to the queued request). The router's
    estimate of what goes before it (services/router/decide/saturation.py)."""
    budget = deadline_tokens(ttft_budget_s, tokens_per_s, max_step_ms)
    if budget is None or budget < num_tokens:  # none, or one it cannot meet: its length
        return num_tokens
    return max(1, min(num_tokens, budget - num_tokens))


def keep_deadline(request: Request, clock: int, rates: StepRates, max_step_ms: float) -> None:
    """On arrival: the request's TTFT budget as a work-clock deadline (see the module's
    docstring), when deadline_tokens finds one to keep; one it cannot meet is kept too,
    and makes it late from the start."""
    needed = num_prefill_needed(request)
    budget = deadline_tokens(request.slo.ttft_budget_s, rates.prefill_tokens_per_s, max_step_ms)
    if budget is not None:
        request.clocks.deadline = clock + budget
        request.clocks.latest_start = clock + budget - needed


# how much slower a request that has lost its first token's deadline ages: newcomers still
# on time overtake it until this many times its length in prompt work has been done for
# others since it arrived (its length alone before: a lost long prompt then held back the
# short ones arriving after it, which lost their first tokens too; docs/benchmarks_history.md)
LATE_AGING_DIVISOR = 4


def prefill_order(name: str) -> PrefillOrder:
    if name == "srpt":
        return ShortestRemainingFirst()
    return FirstComeFirstServed()


# The load report's rank buckets: (previous edge, edge], the lowest from any rank up to 16,
# the highest above 65,536. Powers of two: a new request's own bucket, the one the router
# cannot split, holds at most twice its length.
RANK_EDGES = tuple(16 << i for i in range(13))
NO_RANK_LIMIT = (1 << 32) - 1


def summarize_queue(requests: Iterable[Request], order: PrefillOrder, clock: int) -> tuple[QueuedPrefill, ...]:
    """The prefill work queued (waiting, and running prompts' rest), grouped by priority and
    rank bucket: at most len(RANK_EDGES) + 1 entries per priority, lowest first."""
    buckets: dict[tuple[int, int], list[int]] = {}
    for request in requests:
        needed = num_prefill_needed(request)
        if needed <= 1:
            continue  # a decode
        edge = bisect.bisect_left(RANK_EDGES, order.rank(request, clock))
        counts = buckets.setdefault((request.priority, edge), [0, 0])
        counts[0] += 1
        counts[1] += needed
    return tuple(QueuedPrefill(priority, RANK_EDGES[edge - 1] if edge else 0,
                               RANK_EDGES[edge] if edge < len(RANK_EDGES) else NO_RANK_LIMIT, n, tokens)
                 for (priority, edge), (n, tokens) in sorted(buckets.items()))
