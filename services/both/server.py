"""A worker of both roles: the prefill and the decode servicers over one engine loop.

    router ──Prefill(long prompt)──▶ ┌──────────── worker (both) ────────────┐
                                     │ PrefillServicer ─┐                     │
    router ──Decode(short prompt,    │                  ├─▶ one EngineLoop    │──▶ kvstore
            or a hand-off)─────────▶ │ DecodeServicer ──┘   (one KV cache)    │
                                     └────────────────────────────────────────┘

Each servicer is the one its pool's workers run, unchanged: a prefill here writes its KV
to the kvstore for another worker's decode; a decode here takes hand-offs from other
workers and prompts it prefills itself (the direct path). The router never hands a
prompt over from this worker to itself (decide/paths.py, "same_worker"): it sends it
direct instead, so no KV goes through the kvstore that the engine already holds.

Both answer GetLoad with the same report (load_to_proto of the one engine's stats): its
queued prefill, measured prefill rate and decode step time, free KV blocks and running
sequences serve the prefill pool's estimates and the decode pool's alike.
"""
from __future__ import annotations

from pdserve.services.decode.server import decode_service
from pdserve.services.prefill.server import prefill_service
from pdserve.services.worker.config import WorkerConfig
from pdserve.services.worker.runtime import RunningWorker, serve_worker

ROLE = "both"


def serve(cfg: WorkerConfig, loaded=None) -> RunningWorker:
    """DecodeWorker first: `RunningWorker.servicer` is the decode servicer, as on a decode worker."""
    return serve_worker(cfg, loaded, ROLE, [decode_service(cfg), prefill_service(cfg)])
