"""The terminal table and the JSON file of a run."""
from __future__ import annotations

import json
import math
import os


def _ms(v) -> str:
    return "-" if v is None else f"{v * 1000:.2f}"


def table(summary: dict, title: str = "") -> str:
    s = summary
    lines = [f"{'=' * 16} Serving benchmark {title} {'=' * 16}"]
    rows = [
        ("Requests completed / failed", f"{s['completed']} / {s['failed']}"),
        ("Duration (s)", f"{s['duration_s']:.2f}"),
        ("Prompt tokens", f"{s['prompt_tokens']}"),
        ("Output tokens (asked)", f"{s['output_tokens']} ({s['expected_output_tokens']})"),
        ("Cached prompt tokens", f"{s['cached_tokens']}"),
        ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{s['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{s['total_token_throughput']:.2f}"),
    ]
    slo = s["slo"]
    slo_text = (f"TTFT <= {_ms(slo['ttft_s'])} ms, TPOT <= {_ms(slo['tpot_s'])} ms"
                if slo["ttft_s"] is not None or slo["tpot_s"] is not None else "no SLO given")
    rows.append(("SLO", slo_text))
    rows.append(("Goodput", f"{s['goodput']['requests']} req, {100 * s['goodput']['share']:.1f}%, "
                            f"{s['goodput']['rate']:.2f} req/s"))
    if s.get("paths"):
        rows.append(("Requests by path", ", ".join(f"{path} {n}" for path, n in sorted(s["paths"].items()))))
    rows += _spec_rows(s.get("spec_decode"))
    width = max(len(k) for k, _ in rows) + 2
    lines += [f"{k:<{width}}{v}" for k, v in rows]
    head = f"{'(ms)':<{width}}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}"
    lines += ["-" * len(head), head]
    metrics = [("TTFT", s["ttft_s"]), ("TPOT", s["tpot_s"]), ("ITL", s["itl_s"]), ("E2E latency", s["e2e_s"])]
    if s.get("ttft_breakdown"):
        b = s["ttft_breakdown"]
        metrics += [("TTFT: queue", b["queue_s"]), ("TTFT: prefill", b["prefill_s"]),
                    ("TTFT: KV write", b["kv_write_s"]), ("TTFT: other (router)", b["other_s"]),
                    ("TTFT: router total", b["router_ttft_s"]), ("TTFT: client/network", b["client_overhead_s"]),
                    ("After TTFT: KV read", b["kv_read_s"]), ("After TTFT: decode join", b["decode_join_s"]),
                    ("KV transfer (write + read)", b["kv_transfer_s"])]
    for name, st in metrics:
        lines.append(f"{name:<{width}}" + "".join(f"{_ms(st[k]):>10}" for k in ("mean", "p50", "p90", "p99")))
    if s["errors"]:
        lines.append("Errors: " + "; ".join(s["errors"][:5]))
    lines.append("=" * len(head))
    return "\n".join(lines)


def _spec_rows(spec: dict | None) -> list[tuple[str, str]]:
    """Speculative decoding over the run, from the workers' counters (--worker-metrics)."""
    if spec is None:
        return []
    if "error" in spec:
        return [("Speculative decoding", f"unknown ({spec['error']})")]
    rate, length = spec["acceptance_rate"], spec["mean_accepted_length"]
    return [("Spec decode: drafts accepted / proposed", f"{spec['accepted_tokens']} / {spec['proposed_tokens']}"),
            ("Spec decode: acceptance rate", "-" if rate is None else f"{100 * rate:.1f}%"),
            ("Spec decode: mean accepted length", "-" if length is None else
             f"{length:.2f} per verification ({spec['verifications']})")]


def _clean(obj):
    """JSON without Infinity/NaN (null instead)."""
    if isinstance(obj, float) and (math.isinf(obj) or math.isnan(obj)):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def write_json(path: str, result: dict) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(_clean(result), f, indent=1)
    return path
