import math

import pytest

from pdserve.cli.bench.metrics import SLO, RequestRecord, meets_slo, record_from, stats, summarize
from pdserve.cli.bench.report import table
from pdserve.cli.bench.targets import Outcome

TIMINGS = {"router_queue_s": 0.01, "prefill_queue_s": 0.02, "prefill_s": 0.1, "kv_write_s": 0.003,
           "kv_read_s": 0.004, "decode_join_s": 0.005, "ttft_s": 0.15}


def rec(i, ttft, e2e, out_tokens, error="", timings=None, itl=()):
    tpot = (e2e - ttft) / (out_tokens - 1) if out_tokens > 1 and not error else None
    return RequestRecord(index=i, scheduled_s=0.0, start_s=0.0, prompt_tokens=10, output_tokens=out_tokens,
                         expected_output_tokens=out_tokens, ttft_s=None if error else ttft,
                         e2e_s=None if error else e2e, tpot_s=tpot, itl_s=tuple(itl), chunk_offsets_s=(),
                         error=error, timings=timings)


def test_percentiles():
    s = stats(range(1, 101))
    assert s["n"] == 100 and s["mean"] == 50.5 and s["min"] == 1 and s["max"] == 100
    assert s["p50"] == pytest.approx(50.5) and s["p90"] == pytest.approx(90.1) and s["p99"] == pytest.approx(99.01)
    assert stats([None, 2.0])["p99"] == 2.0
    assert stats([])["mean"] is None


def test_record_from_outcome():
    out = Outcome(sent=10.0, chunks=[(10.5, 1), (10.6, 1), (10.8, 2)], prompt_tokens=7, output_tokens=4,
                  finish_reason="length")
    r = record_from(0, 0.25, 9.5, 4, out, finished=10.9)
    assert r.ok and r.start_s == pytest.approx(0.5) and r.ttft_s == pytest.approx(0.5)
    assert r.e2e_s == pytest.approx(0.8) and r.tpot_s == pytest.approx(0.1)
    assert r.itl_s == pytest.approx((0.1, 0.1, 0.1))
    failed = record_from(1, 0.0, 9.5, 4, Outcome(sent=10.0, error="UNAVAILABLE: x"), finished=10.1)
    assert not failed.ok and failed.ttft_s is None


def test_goodput_on_hand_made_records():
    records = [
        rec(0, 0.1, 1.0, 10),   # tpot 0.1
        rec(1, 0.3, 1.2, 10),   # ttft too slow for 0.2
        rec(2, 0.1, 2.8, 10),   # tpot 0.3: too slow for 0.2
        rec(3, 0.15, 0.15, 1),  # one token: TPOT undefined, meets any TPOT SLO
        rec(4, 0, 0, 5, error="UNAVAILABLE"),
    ]
    slo = SLO(ttft_s=0.2, tpot_s=0.2)
    assert [meets_slo(r, slo) for r in records] == [True, False, False, True, False]
    s = summarize(records, duration_s=2.0, slo=slo)
    assert (s["num_requests"], s["completed"], s["failed"]) == (5, 4, 1)
    assert s["goodput"] == {"requests": 2, "share": 0.4, "rate": 1.0}
    assert s["output_tokens"] == 31 and s["prompt_tokens"] == 40
    assert s["request_throughput"] == 2.0 and s["output_throughput"] == 15.5
    assert s["ttft_s"]["mean"] == pytest.approx(0.1625)
    assert s["tpot_s"]["n"] == 3 and s["tpot_s"]["p50"] == pytest.approx(0.1)
    assert s["errors"] == ["UNAVAILABLE"] and s["ttft_breakdown"] is None
    no_slo = summarize(records, 2.0)
    assert no_slo["goodput"]["requests"] == 4 and no_slo["slo"] == {"ttft_s": None, "tpot_s": None}
    assert "Goodput" in table(s) and "TTFT" in table(no_slo)


def test_ttft_breakdown():
    records = [rec(0, 0.2, 1.0, 5, timings=TIMINGS), rec(1, 0.3, 1.0, 5, timings=TIMINGS), rec(2, 0.2, 1.0, 5)]
    b = summarize(records, 1.0)["ttft_breakdown"]
    assert b["queue_s"]["mean"] == pytest.approx(0.03) and b["prefill_s"]["mean"] == pytest.approx(0.1)
    assert b["kv_write_s"]["mean"] == pytest.approx(0.003) and b["other_s"]["mean"] == pytest.approx(0.017)
    assert b["kv_transfer_s"]["mean"] == pytest.approx(0.007) and b["decode_join_s"]["p99"] == pytest.approx(0.005)
    assert b["kv_read_s"]["p50"] == pytest.approx(0.004)
    assert b["router_ttft_s"]["n"] == 2 and b["client_overhead_s"]["mean"] == pytest.approx(0.1)
    assert "KV transfer" in table(summarize(records, 1.0))
    assert not math.isnan(b["client_overhead_s"]["p90"])
