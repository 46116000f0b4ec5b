"""What a caller hands the engine for one request: the one typed entry that
EngineCore.add_request and the worker's EngineLoop.submit both take."""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.kv_transfer import KVPayload
from pdserve.engine.request import RequestMode
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.slo import NO_SLO, SLOTargets


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
    slo: SLOTargets = NO_SLO  # its SLO class's latency targets (engine/slo.py)
