"""Per-request records and the run's summary: TTFT, ITL, TPOT and end-to-end latency
(mean, p50, p90, p99), throughput, goodput under a TTFT and a TPOT SLO, and the TTFT
split from the services' own timings.

Definitions (as `vllm bench serve`): TTFT from send to the first token's chunk; ITL the
gaps between successive chunks, a chunk of k tokens counting as k gaps of 1/k of its
gap; TPOT (e2e - TTFT) / (output tokens - 1), for requests with more than one token;
goodput: requests that succeeded with TTFT <= slo_ttft and TPOT <= slo_tpot (a
one-token request meets any TPOT SLO)."""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass

import numpy as np

from pdserve.cli.bench.targets import Outcome

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class SLO:
    ttft_s: float = math.inf
    tpot_s: float = math.inf


@dataclass(frozen=True)
class RequestRecord:
    index: int
    scheduled_s: float       # planned send offset from the run's start
    start_s: float           # actual send offset
    prompt_tokens: int
    output_tokens: int
    expected_output_tokens: int
    ttft_s: float | None
    e2e_s: float | None
    tpot_s: float | None
    itl_s: tuple[float, ...]
    chunk_offsets_s: tuple[float, ...]  # each token chunk's arrival, from the send
    cached_tokens: int = 0
    finish_reason: str = ""
    error: str = ""
    timings: dict | None = None
    path: str = ""  # the router's choice (gRPC target only; "" when unknown)

    @property
    def ok(self) -> bool:
        return not self.error and self.ttft_s is not None

    def to_json(self) -> dict:
        return asdict(self)


def record_from(index: int, scheduled_s: float, run_start: float, expected: int, out: Outcome,
                finished: float) -> RequestRecord:
    times = [t for t, _ in out.chunks]
    ttft = times[0] - out.sent if times else None
    itl: list[float] = []
    for (prev, _), (t, n) in zip(out.chunks, out.chunks[1:]):
        itl.extend([(t - prev) / n] * n)
    e2e = (times[-1] if times else finished) - out.sent
    error = out.error or ("" if times else "no tokens")
    tpot = (e2e - ttft) / (out.output_tokens - 1) if ttft is not None and out.output_tokens > 1 else None
    return RequestRecord(index=index, scheduled_s=scheduled_s, start_s=out.sent - run_start,
                         prompt_tokens=out.prompt_tokens, output_tokens=out.output_tokens,
                         expected_output_tokens=expected, ttft_s=ttft, e2e_s=e2e if not error else None,
                         tpot_s=tpot, itl_s=tuple(itl), chunk_offsets_s=tuple(t - out.sent for t in times),
                         cached_tokens=out.cached_tokens, finish_reason=out.finish_reason, error=error,
                         timings=out.timings, path=out.path)


def stats(values) -> dict:
    """mean, p50, p90, p99 (linear interpolation), min, max and n; None values skipped."""
    v = np.asarray([x for x in values if x is not None], dtype=float)
    if v.size == 0:
        return {"n": 0, "mean": None, **{f"p{p}": None for p in PERCENTILES}, "min": None, "max": None}
    return {"n": int(v.size), "mean": float(v.mean()), **{f"p{p}": float(np.percentile(v, p)) for p in PERCENTILES},
            "min": float(v.min()), "max": float(v.max())}


def meets_slo(r: RequestRecord, slo: SLO) -> bool:
    return r.ok and r.ttft_s <= slo.ttft_s and (r.tpot_s is None or r.tpot_s <= slo.tpot_s)


def ttft_breakdown(records: list[RequestRecord]) -> dict | None:
    """The TTFT split from the services' own timings (gRPC target), in seconds:

    - inside the router's TTFT (admission until the first token was sent), which they
      add up to: queue (router queue + prefill worker queue), prefill, kv_write (prefill
      -> kvstore) and other (the rest: kvstore lookups and prefix imports, RPCs, the
      first token's way back; on the direct path of short prompts the decode worker's
      prefill);
    - after it on the disaggregated path, before the second token: kv_read (kvstore ->
      decode) and decode_join (decode worker admission until its first step);
    - kv_transfer = kv_write + kv_read, and client_overhead = the client's TTFT minus the
      router's (network, stream, client).
    None when no record has timings."""
    timed = [r for r in records if r.ok and r.timings]
    if not timed:
        return None

    def part(f, r):
        return r.timings[f]

    inside = ("router_queue_s", "prefill_queue_s", "prefill_s", "kv_write_s")
    parts = {
        "queue_s": [part("router_queue_s", r) + part("prefill_queue_s", r) for r in timed],
        "prefill_s": [part("prefill_s", r) for r in timed],
        "kv_write_s": [part("kv_write_s", r) for r in timed],
        "other_s": [part("ttft_s", r) - sum(part(f, r) for f in inside) for r in timed],
        "router_ttft_s": [part("ttft_s", r) for r in timed],
        "client_overhead_s": [r.ttft_s - part("ttft_s", r) for r in timed],
        "kv_read_s": [part("kv_read_s", r) for r in timed],
        "decode_join_s": [part("decode_join_s", r) for r in timed],
        "kv_transfer_s": [part("kv_write_s", r) + part("kv_read_s", r) for r in timed],
        "router_queue_s": [part("router_queue_s", r) for r in timed],
        "prefill_queue_s": [part("prefill_queue_s", r) for r in timed],
    }
    return {name: stats(v) for name, v in parts.items()}


def summarize(records: list[RequestRecord], duration_s: float, slo: SLO = SLO()) -> dict:
    ok = [r for r in records if r.ok]
    good = [r for r in ok if meets_slo(r, slo)]
    duration_s = max(duration_s, 1e-9)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    return {
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration_s,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "expected_output_tokens": sum(r.expected_output_tokens for r in ok),
        "cached_tokens": sum(r.cached_tokens for r in ok),
        "request_throughput": len(ok) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (prompt_tokens + output_tokens) / duration_s,
        "ttft_s": stats(r.ttft_s for r in ok),
        "tpot_s": stats(r.tpot_s for r in ok),
        "itl_s": stats(x for r in ok for x in r.itl_s),
        "e2e_s": stats(r.e2e_s for r in ok),
        "slo": {"ttft_s": None if math.isinf(slo.ttft_s) else slo.ttft_s,
                "tpot_s": None if math.isinf(slo.tpot_s) else slo.tpot_s},
        "goodput": {"requests": len(good), "share": len(good) / len(records) if records else 0.0,
                    "rate": len(good) / duration_s},
        "ttft_breakdown": ttft_breakdown(records),
        "paths": dict(Counter(r.path for r in ok if r.path)),
        "errors": sorted({r.error for r in records if r.error}),
    }
