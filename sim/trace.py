"""Mooncake-format traces: one JSON object a line,

    {"timestamp": 1200, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ...]}

`timestamp` in milliseconds; each hash id names one block of `block_size` (512) prompt
tokens and is prefix-chained (the same id at the same place means the same prefix), so
it is what prefix caches reuse. The bench client reads the same files (cli/bench/datasets.py).
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

TRACE_BLOCK_SIZE = 512  # tokens per hash id, Mooncake's


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float              # from the trace's first request
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...] = ()


def parse_trace(lines: Iterable[str], source: str = "trace") -> list[TraceRequest]:
    """Every record, arrival times relative to the first; a bad record raises ValueError
    naming its line and field."""
    out, t0 = [], None
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{source} line {lineno}: not JSON ({e.msg})") from None
        if not isinstance(rec, dict):
            raise ValueError(f"{source} line {lineno}: must be a JSON object")
        ts = _number(rec, "timestamp", source, lineno, minimum=None)
        n_in = int(_number(rec, "input_length", source, lineno, minimum=1, integer=True))
        n_out = int(_number(rec, "output_length", source, lineno, minimum=1, integer=True))
        hash_ids = rec.get("hash_ids") or []
        if not isinstance(hash_ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in hash_ids):
            raise ValueError(f"{source} line {lineno}: field 'hash_ids' must be a list of integers")
        t0 = ts if t0 is None else t0
        if ts < t0 or (out and (ts - t0) / 1000.0 < out[-1].arrival_s):
            raise ValueError(f"{source} line {lineno}: field 'timestamp' goes backwards ({ts})")
        out.append(TraceRequest((ts - t0) / 1000.0, n_in, n_out, tuple(hash_ids)))
    if not out:
        raise ValueError(f"{source}: no requests")
    return out


def _number(rec: dict, name: str, source: str, lineno: int, minimum: float | None, integer: bool = False) -> float:
    if name not in rec:
        raise ValueError(f"{source} line {lineno}: missing field '{name}'")
    value = rec[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and value != int(value)):
        raise ValueError(f"{source} line {lineno}: field '{name}' must be a{'n integer' if integer else ' number'}, "
                         f"got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{source} line {lineno}: field '{name}' must be >= {minimum}, got {value}")
    return float(value)


def load_trace(path: str) -> list[TraceRequest]:
    try:
        with open(path, encoding="utf-8") as f:
            return parse_trace(f, source=path)
    except OSError as e:
        raise ValueError(f"--trace: cannot read {path} ({e.strerror})") from None


def trace_lines(requests: Iterable[TraceRequest]) -> list[str]:
    """JSONL lines of `requests` (timestamps in whole milliseconds)."""
    return [json.dumps({"timestamp": round(r.arrival_s * 1000), "input_length": r.input_length,
                        "output_length": r.output_length, "hash_ids": list(r.hash_ids)}) for r in requests]


def write_trace(path: str, requests: Iterable[TraceRequest]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(trace_lines(requests)) + "\n")
