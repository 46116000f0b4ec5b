"""The simulator-against-goodput bench replays goodput_vs_vllm's own traces: the same
requests and arrivals, in the Mooncake format the bench client and the simulator read."""
from __future__ import annotations

import json
import math

import pytest

from bench import goodput_vs_vllm, sim_goodput
from pdserve.sim.trace import TRACE_BLOCK_SIZE, load_trace


def test_the_traces_are_goodput_vs_vllms_requests_in_milliseconds(tmp_path):
    args = sim_goodput.parse_args(["--rates", "0.8", "--long-shares", "0.3", "--duration-s", "100",
                                   "--out-dir", str(tmp_path)])
    traces = sim_goodput._traces(args)
    path, requests = traces["long0.3_rate0.8"]
    vllm_args = goodput_vs_vllm.parse_args(["--vllm-python", "x", "--duration-s", "100"])
    goodput_vs_vllm.write_trace(str(tmp_path / "theirs.jsonl"), 0.8, 0.3, vllm_args)
    theirs = [json.loads(line) for line in (tmp_path / "theirs.jsonl").read_text().splitlines()]
    assert [(r.input_length, r.output_length) for r in requests] == [(t["input_length"], t["output_length"])
                                                                   for t in theirs]
    t0 = theirs[0]["timestamp"]
    assert [r.arrival_s for r in requests] == pytest.approx([t["timestamp"] - t0 for t in theirs], abs=1e-6)
    lines = [json.loads(line) for line in open(path)]
    assert lines[-1]["timestamp"] == round(1000 * (theirs[-1]["timestamp"] - t0))  # ms on disk
    assert load_trace(path) == requests
    ids = [h for r in requests for h in r.hash_ids]
    assert len(ids) == len(set(ids))  # still no prefix shared
    assert all(len(r.hash_ids) == math.ceil(r.input_length / TRACE_BLOCK_SIZE) for r in requests)


def test_the_error_is_relative_to_the_measured_goodput():
    assert sim_goodput.error_pct(0.55, 0.5) == 10.0
    assert sim_goodput.error_pct(0.4, 0.5) == -20.0
    assert sim_goodput.error_pct(0.1, 0.0) is None


def test_an_unknown_platform_or_slo_is_refused():
    with pytest.raises(SystemExit):
        sim_goodput.parse_args(["--platforms", "pdserve,vllm"])
    with pytest.raises(SystemExit):
        sim_goodput.parse_args(["--slo-ttft-ms", "0"])
