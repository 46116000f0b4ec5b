"""`pdserve up --autoscale` on loopback: a burst of long prompts pushes the prefill pool's
TTFT over its target and the controller starts a second prefill worker, which the router
then uses; once the burst ends the pool drains back to minReplicas after the scale-down
window. Short prompts (the direct path) keep flowing the whole time. No request fails,
and the decision log shows both moves.

The targets and windows are the chart's values merged with tests/cli/autoscale_values.yaml
(short windows; tests/deploy/test_chart_hpa_specs.py renders the chart with it).
"""
from __future__ import annotations

import random
import re
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from pdserve.cli.autoscale import load_values, merge_values
from pdserve.cli.bench.datasets import BenchRequest
from pdserve.cli.bench.targets import GrpcTarget, TargetConfig
from tests.cli.up_platform import Platform, running_up, up_ports

VALUES = Path(__file__).with_name("autoscale_values.yaml")
DECISION = re.compile(r"autoscale t=(?P<t>[\d.]+)s pool=(?P<pool>\w+) current=(?P<current>\d+) "
                      r"metric=(?P<metric>\S+) target=(?P<target>\S+) raw=(?P<raw>\d+) desired=(?P<desired>\d+) "
                      r"reason=(?P<reason>.*)$")
LONG, SHORT = 400, 8  # prompt tokens: over and under --short-prompt-tokens


class Load:
    """Client threads sending one kind of prompt back to back until stopped."""

    def __init__(self, router: str, num_threads: int, prompt_len: int, seed: int):
        self.target = GrpcTarget(TargetConfig("grpc", router, timeout_s=120))
        self.errors: list[str] = []
        self.num_done = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(prompt_len, seed + i), daemon=True)
                         for i in range(num_threads)]
        for t in self._threads:
            t.start()

    def _run(self, prompt_len: int, seed: int) -> None:
        rng = random.Random(seed)
        while not self._stop.is_set():
            prompt = tuple(rng.randrange(1000, 40000) for _ in range(prompt_len))
            out = self.target.send(BenchRequest(prompt=prompt, prompt_len=prompt_len, output_len=4))
            if out.error or out.output_tokens != 4:
                self.errors.append(out.error or f"{out.output_tokens} tokens")
            self.num_done += 1

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=150)
        self.target.close()


def ttft_count(metrics_url: str) -> float:
    text = urllib.request.urlopen(metrics_url, timeout=2).read().decode()
    match = re.search(r"^pdserve_worker_ttft_seconds_count (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


@pytest.fixture(scope="module")
def platform(tiny_llama_dir, tmp_path_factory):
    args = ["--prefill", "1", "--decode", "1", "--path-policy", "threshold", "--short-prompt-tokens", "32",
            "--autoscale", "--autoscale-values", str(VALUES), "--autoscale-sync-s", "1"]
    with running_up(tiny_llama_dir, up_ports(2), args, tmp_path_factory.mktemp("autoscale")) as up:
        yield up


def decisions(up: Platform, pool: str, start: int = 0) -> list[dict]:
    found = [DECISION.search(line) for line in up.lines[start:]]
    return [m.groupdict() for m in found if m and m["pool"] == pool]


def test_a_burst_grows_the_prefill_pool_and_it_drains_back_without_a_failed_request(platform):
    up = platform
    short = Load(up.router, 1, SHORT, seed=100)  # the direct path, all along
    burst = Load(up.router, 4, LONG, seed=0)
    try:
        up.wait_for(r"autoscale: starting prefill-\d+ ", timeout_s=60)
        # a new worker serves, joins the router's pool and takes part of the burst (on a
        # loaded machine the HPA may first drop one still starting, as it would in a cluster)
        name = up.wait_for(r"autoscale: (prefill-\d+) serving on .* added to the router's prefill pool",
                           timeout_s=240).group(1)
        metrics_url = up.wait_for(rf"autoscale: starting {name} on \S+, metrics (\S+) ", timeout_s=1).group(1)
        deadline = time.monotonic() + 60
        while ttft_count(metrics_url) < 3 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert ttft_count(metrics_url) >= 3, f"the router sent nothing to {name}:\n{up.log()}"
    finally:
        burst.stop()
    mark = up.mark()
    try:
        drained = up.wait_for(r"autoscale: (prefill-\d+) drained and exited \(code (-?\d+)\)", timeout_s=60,
                              start=mark)
    finally:
        short.stop()
    assert drained.group(2) == "0", "the worker drained and exited on its own (not killed after its grace)"
    assert burst.errors == [] and short.errors == [], (burst.errors[:5], short.errors[:5])
    assert burst.num_done > 0 and short.num_done > 0

    ups = [d for d in decisions(up, "prefill") if int(d["desired"]) > int(d["current"])]
    assert ups and float(ups[0]["metric"]) > float(ups[0]["target"]) * 1.1, "scaled up on TTFT over target"
    assert (ups[0]["current"], ups[0]["desired"]) == ("1", "2")
    downs = [d for d in decisions(up, "prefill", mark) if int(d["desired"]) < int(d["current"])]
    assert downs and (downs[0]["current"], downs[0]["desired"]) == ("2", "1")
    # the scale-down waited out the 5 s window after the last recommendation of 2
    down_t = float(downs[0]["t"])
    last_two = max(float(d["t"]) for d in decisions(up, "prefill") if int(d["raw"]) >= 2 and float(d["t"]) < down_t)
    # the log prints t to 0.1 s, so two rounded times may read up to 0.1 s short of the real gap
    assert down_t - last_two >= 5.0 - 0.1 - 1e-9
    assert decisions(up, "decode"), "the decode pool's HPA runs too (min = max = 1 here)"
    assert not any(re.search(r"restarted prefill-[1-9]", line) for line in up.lines), "a drained worker came back"
    assert decisions(up, "prefill")[-1]["current"] == "1"


def test_values_merge_like_helm_and_a_bad_override_names_the_flag(tmp_path):
    merged = load_values([str(VALUES)])
    assert merged["prefill"]["autoscaling"]["maxReplicas"] == 2
    assert merged["prefill"]["autoscaling"]["metric"]["quantile"] == 0.9  # kept from the chart
    assert merge_values({"a": {"b": 1, "c": [1]}}, {"a": {"c": [2]}}) == {"a": {"b": 1, "c": [2]}}
    bad = tmp_path / "bad.yaml"
    bad.write_text("- not a mapping\n")
    with pytest.raises(ValueError, match="--autoscale-values"):
        load_values([str(bad)])
