"""What a caller hands the engine for one request: the one typed entry that
EngineCore.add_request and the worker's EngineLoop.submit both take."""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.kv_transfer import KVPayload
from pdserve.engine.request import RequestMode
from pdserve.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class EngineRequest:
    """Disaggregated serving (see RequestMode): a prefill worker sends PREFILL_ONLY
    requests (a handed-off output carries the prompt's KV) and may pass a cached prefix
    as `kv_import`; a decode worker sends DECODE_ONLY ones, with the tokens the prefill
    emitted as `output_token_ids` and the prompt's KV as `kv_import`."""
    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None  # the prompt's text, echoed in the output
    mode: RequestMode = RequestMode.COLOCATED
    output_token_ids: list[int] = ()
    kv_import: KVPayload | None = None
    priority: int = 0
    prefill_chunk_tokens: int = 0  # caps this request's prefill chunks below the engine's own; 0: no cap
    cache_salt: str = ""  # the request shares cached KV only with requests of the same salt
    # seconds left to the first token's target when it was sent (0: none): srpt lets newer
    # prompts overtake it only while it can still meet that (engine/core/prefill_order.py)
    ttft_budget_s: float = 0.0
    # the tightest TTFT target among the sending router's SLO classes (0: none): what a
    # request arriving behind it may need, so how long a step may last (engine/core/step_bound.py)
    min_class_ttft_s: float = 0.0
    # the mean inter-token time (TPOT) its stream keeps, the class's ITL target (0: none);
    # the engine reports its streams' room under it (EngineStats.tpot_stall_room_ms)
    itl_target_s: float = 0.0
