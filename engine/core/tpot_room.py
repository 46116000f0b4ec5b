"""How long a worker's running streams could still be paused and keep their TPOT targets.

An SLO's TPOT is a stream's mean time between tokens after the first, not one gap: a
stream of L tokens with target T may take T x (L - 1) for them in all. Paused by a long
prompt's prefill, it spends part of that; what it has left, were its other tokens to come
at the current decode step, is its room:

    room = T x (L - a) - (now - t_a) - (L - g) x step

where (t_a, a) is when it had its first a tokens (its first token here, or those given to
it: a decode-only request's first token from the prefill worker, a resumed stream's), g the
tokens it has now and L the most it may have (max_tokens, within the context). The worker
reports the least room of its streams: a router may send it a prompt whose prefill
(with the prompts queued before it) takes no more than that, in larger chunks than the
streams' per-step ITL room allows, when the prompt would otherwise miss its own TTFT
target (docs/router.md, rule 4).

A stream that ends sooner than L (a stop token) has a mean over fewer gaps than counted
here, so a router spends only a share of the room (services/router/decide/paths.py).
"""
from __future__ import annotations

import math
from collections.abc import Iterable

from pdserve.engine.request import Request


def stream_room_s(request: Request, now: float, step_s: float, max_model_len: int) -> float | None:
    """The request's room in seconds; None when it keeps no TPOT target (none given, no
    first token yet, or no token left to come)."""
    if request.slo.itl_target_s <= 0 or request.tpot_anchor is None:
        return None
    anchor_time, anchor_tokens = request.tpot_anchor
    most = min(request.sampling_params.max_tokens, max_model_len - request.num_prompt_tokens)
    if most <= request.num_output_tokens:
        return None
    budget = request.slo.itl_target_s * (most - anchor_tokens)
    return budget - (now - anchor_time) - (most - request.num_output_tokens) * step_s


def tpot_stall_room_s(running: Iterable[Request], now: float, step_s: float, max_model_len: int) -> float:
    """The least room of the streams that keep a target (never below 0); inf when none
    does. 0 while the decode step is unmeasured: nothing is known of their pace."""
    rooms = [r for r in (stream_room_s(q, now, step_s, max_model_len) for q in running) if r is not None]
    if not rooms:
        return math.inf
    if step_s <= 0:
        return 0.0
    return max(0.0, min(rooms))
