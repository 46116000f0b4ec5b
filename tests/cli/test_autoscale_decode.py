"""`pdserve up --autoscale` shrinking the decode pool while streams run on the worker it
drains: the HPA (tests/cli/autoscale_decode_values.yaml) takes decode from 2 to 1 once
its scale-down window has passed, and the newest worker, decode-1, gets SIGTERM with
streams open on it. It refuses new work, finishes every stream it holds, exits 0 and
leaves the router's pool; the supervisor does not restart it.

Every stream started before, during and after the drain completes with all its tokens,
equal to the same prompt's greedy tokens once only decode-0 is left."""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pdserve.engine import SamplingParams
from pdserve.services.router.client import RouterClient
from tests.cli.test_autoscale import decisions
from tests.cli.up_platform import running_up, up_ports

VALUES = Path(__file__).with_name("autoscale_decode_values.yaml")
GREEDY = SamplingParams(max_tokens=160, temperature=0.0, ignore_eos=True)
# short prompts and long ones (over --short-prompt-tokens: through the prefill worker)
PROMPTS = [f"stream {i}: " + "the quick brown fox jumps over the lazy dog " * (1 + 3 * (i % 2)) for i in range(6)]


@pytest.fixture(scope="module")
def platform(tiny_llama_dir, tmp_path_factory):
    args = ["--prefill", "1", "--decode", "2", "--path-policy", "threshold", "--short-prompt-tokens", "24",
            "--autoscale", "--autoscale-values", str(VALUES), "--autoscale-sync-s", "1"]
    # INFO: the drained worker's own count of its open calls is what the test reads
    with running_up(tiny_llama_dir, up_ports(3), args, tmp_path_factory.mktemp("autoscale-decode"),
                    env=dict(os.environ, PDSERVE_LOG_LEVEL="INFO")) as up:
        yield up


class Streams:
    """One client thread per prompt, streaming it again and again until stopped."""

    def __init__(self, router: str):
        self.router = router
        self.outputs: dict[int, list[list[int]]] = {i: [] for i in range(len(PROMPTS))}
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(len(PROMPTS))]
        for t in self._threads:
            t.start()

    def _run(self, i: int) -> None:
        with RouterClient(self.router) as client:
            while not self._stop.is_set():
                try:
                    generation = client.generate_text(PROMPTS[i], GREEDY, timeout_s=120)
                except Exception as e:  # noqa: BLE001 - a failed stream is what the test counts
                    self.errors.append(f"prompt {i}: {e}")
                    continue
                self.outputs[i].append(list(generation.token_ids))

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=180)


def _generate(router: str, prompt: str) -> list[int]:
    with RouterClient(router) as client:
        return list(client.generate_text(prompt, GREEDY, timeout_s=120).token_ids)


def test_the_decode_pool_drains_a_worker_with_open_streams_and_loses_none(platform):
    up = platform
    streams = Streams(up.router)
    try:
        # the HPA's first sync counted 2 replicas as a recommendation: 1 only after the window
        draining = up.wait_for(r"autoscale: draining (decode-\d+) \(pid \d+\)", timeout_s=120)
        assert draining.group(1) == "decode-1", "the newest decode worker goes first"
        mark = up.mark()
        # the worker's own count of its calls when SIGTERM came: a sampled /metrics gauge
        # could read 0 once the drain had already finished the streams
        open_streams = int(up.wait_for(r"\[\s*decode-1\] .*draining and stopping: (\d+) calls in flight",
                                       timeout_s=60).group(1))
        exited = up.wait_for(r"autoscale: decode-1 drained and exited \(code (-?\d+)\)", timeout_s=150, start=mark)
        after_drain = len(up.lines)
    finally:
        streams.stop()
    assert open_streams >= 1, "decode-1 held streams when it was told to drain"
    assert exited.group(1) == "0", "it finished its streams and exited on its own (not killed after its grace)"
    assert streams.errors == [], streams.errors[:5]

    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # decode-0 alone now
        reference = list(pool.map(lambda p: _generate(up.router, p), PROMPTS))
    assert all(len(r) == GREEDY.max_tokens for r in reference)
    for i, outputs in streams.outputs.items():
        assert outputs, f"prompt {i} never completed"
        assert all(out == reference[i] for out in outputs), f"prompt {i}: a stream differs from the greedy tokens"

    downs = [d for d in decisions(up, "decode") if int(d["desired"]) < int(d["current"])]
    assert downs and (downs[0]["current"], downs[0]["desired"]) == ("2", "1")
    assert float(downs[0]["t"]) >= 12.0, "not before the 12 s scale-down window"
    assert float(downs[0]["metric"]) < float(downs[0]["target"])
    assert not any("restarted decode-1" in line for line in up.lines), "a drained worker came back"
    assert not any("decode-1" in line and "serving again" in line for line in up.lines[after_drain:])
    assert decisions(up, "decode")[-1]["current"] == "1"
