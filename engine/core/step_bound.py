"""How long a step may last: the worker's --max-step-ms, lengthened for prompts alone when
the TTFT targets of the traffic allow it.

A step is bounded in time so that a prompt arriving behind a long one waits for at most one
step before it joins (srpt then puts it first). The right length is a share of the tightest
TTFT target a newcomer may carry: --max-step-ms (150 ms on a prefill worker) is sized to
the default interactive class's 1 s; an operator whose classes give every first token 6 s
pays for 150 ms steps in chunks too small to amortise a pass over the weights (15-27% of a
long prompt's prefill on a 2-core CPU, bench/prefill_step_bound.py) and gains nothing.

Each prefill request carries the tightest TTFT target among its router's SLO classes
(PrefillRequest.min_class_ttft_ms): not its own class's, since the newcomer the bound is for
may be of any class. A step without decodes may last STEP_SHARE_OF_TTFT of the tightest
target carried by the requests that arrived in the last TARGET_MEMORY_S seconds (routers
with different class tables, or one whose table changed), never less than --max-step-ms:

    bound = max(max_step_ms, STEP_SHARE_OF_TTFT x min(targets seen within TARGET_MEMORY_S))

- A request without a target (0: a client or router that gives none) pins the bound to
  --max-step-ms for TARGET_MEMORY_S: the configured bound is what nothing-known gets.
- Until any request has arrived, the bound is --max-step-ms.
- A step with decodes keeps --max-step-ms: it is an inter-token gap of its streams, which
  their ITL target bounds (a worker of both roles), not a newcomer's TTFT.
- The target is a class's whole TTFT target, not the budget left when the request was
  sent: a router that queued requests under load would otherwise shrink the bound, and the
  prefill rate with it, exactly when the pool is behind.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

# a newcomer waits at most this share of its TTFT target for the step in flight: an
# eighth leaves the rest for the queue ahead of it, its own prefill and the hand-off
STEP_SHARE_OF_TTFT = 1 / 8
# how long a target shapes the bound after its request arrived: long enough to span the
# gaps of a class's traffic, short enough that a deployment whose classes change follows
TARGET_MEMORY_S = 60.0


class StepBound:
    def __init__(self, max_step_ms: float, now: Callable[[], float] = time.monotonic):
        """`max_step_ms`: the configured bound (0: steps bounded by tokens only, left so)."""
        self.max_step_ms = max_step_ms
        self._now = now
        # (arrival, target_ms), arrivals ascending and targets strictly ascending: the front
        # is the tightest target still remembered (a sliding-window minimum)
        self._targets: deque[tuple[float, float]] = deque()

    def note_arrival(self, min_class_ttft_s: float) -> None:
        """A request arrived carrying the tightest TTFT target of its router's classes (0: none)."""
        if not self.max_step_ms:
            return
        now, target_ms = self._now(), 1000 * min_class_ttft_s
        while self._targets and self._targets[-1][1] >= target_ms:
            self._targets.pop()
        self._targets.append((now, target_ms))

    def step_ms(self, with_decodes: bool) -> float:
        """The bound of a step that decodes running streams, or of one that only prefills."""
        if with_decodes or not self.max_step_ms:
            return self.max_step_ms
        horizon = self._now() - TARGET_MEMORY_S
        while self._targets and self._targets[0][0] < horizon:
            self._targets.popleft()
        if not self._targets:
            return self.max_step_ms
        return max(self.max_step_ms, STEP_SHARE_OF_TTFT * self._targets[0][1])
