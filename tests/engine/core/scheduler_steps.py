"""Driving a bare Scheduler step by step, as the engine would with a model that always samples
token 7: shared by the scheduler tests that check exact chunks and orders."""
from __future__ import annotations

from pdserve.engine.core.scheduler import Scheduler
from pdserve.engine.core.scheduler_output import ModelRunnerOutput


def run_step(s: Scheduler) -> dict[str, int]:
    """One step; requests that reach their last token sample one and end at max_tokens
    (a prefill worker's prefill-only requests end at their first). Returns the step's
    tokens by request, in the order the step took them."""
    out = s.schedule()
    sampled = {r: [7] for r in out.num_scheduled_tokens
               if s.requests[r].num_computed_tokens == s.requests[r].num_tokens}
    for request, token_ids in s.update_from_output(out, ModelRunnerOutput(sampled_token_ids=sampled)):
        request.append_output_token(token_ids[0])
        if request.num_output_tokens >= request.sampling_params.max_tokens:
            s.finish_requests([request.req_id], s.check_stop(request))
    return dict(out.num_scheduled_tokens)
