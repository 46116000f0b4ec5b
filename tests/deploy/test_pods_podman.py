"""The chart's pods run from the cpu image, by podman (tests/deploy/kubelet.py), not on a
Kubernetes cluster (no API server can be had here; a small HTTPS one serves the router's
EndpointSlices, tests/deploy/apiserver.py).

The chart is rendered with the cpu values, an API key and an internal token (the Secrets
it renders then reach the containers as the pods reference them), the listen address on
loopback and free ports. The kvstore, one prefill, one decode and the router each run as
their rendered container; their probes pass; a chat completion through the router's
container is token-exact with the offline engine; a decode pod taken down as on scale-down
finishes the stream it serves; every pod exits cleanly on SIGTERM.

`make test-deploy` runs it after `make image` (pytest -m pods); `make test` leaves it out.
"""
from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from tests.deploy.apiserver import EndpointSliceServer
from tests.deploy.chart import FULLNAME, NAMESPACE, VALUES, cpu_image, render_text
from tests.deploy.kubelet import Cluster, image_exists, remove, run_pod, terminate, wait_started
from tests.services.security.procs import free_ports

import yaml

pytestmark = pytest.mark.pods

API_KEY, INTERNAL_TOKEN = "sk-pods-test", "internal-pods-test"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
STREAM_PROMPT = "Once upon a time, in a small village by the sea,"
STREAM_TOKENS = 160   # long enough to be in flight when SIGTERM follows the decode pods' preStop pause
DECODE_PRE_STOP_S = 1  # (the chart's default is 5 s: shorter here, the test waits it out)
ENGINE = dict(dtype="float32", attention_backend="torch", max_num_seqs=16)   # ci/cpu-values.yaml's engine


def rendered(ports: dict[str, int], metrics_port: int) -> list[dict]:
    sets = (f"router.port={ports['router']}", f"router.http.port={ports['http']}", f"kvstore.port={ports['kvstore']}",
            f"kvstore.tcpPort={ports['kv_tcp']}",
            f"prefill.port={ports['prefill']}", f"decode.port={ports['decode']}", f"metricsPort={metrics_port}",
            "listenHost=127.0.0.1", f"decode.preStopSleepSeconds={DECODE_PRE_STOP_S}",
            f"auth.apiKey.value={API_KEY}", f"auth.internalToken.value={INTERNAL_TOKEN}")
    return [d for d in yaml.safe_load_all(render_text(VALUES["cpu"], sets)) if d]


def pod_spec(manifests: list[dict], component: str) -> dict:
    (deployment,) = [d for d in manifests if d["kind"] == "Deployment"
                     and d["metadata"]["name"] == f"{FULLNAME}-{component}"]
    return deployment["spec"]["template"]["spec"]


@pytest.fixture(scope="module")
def offline():
    from pdserve.engine import LLM, SamplingParams
    llm = LLM(model="smollm2", **ENGINE)
    chat = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=16))[0].text
    story = llm.generate(STREAM_PROMPT, SamplingParams(temperature=0, max_tokens=STREAM_TOKENS, ignore_eos=True))[0]
    return {"chat": chat, "story": story.text}


def post(port: int, path: str, body: dict, key: str | None = API_KEY, timeout_s: float = 120):
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), headers=headers)
    return urllib.request.urlopen(request, timeout=timeout_s)


class Stream:
    """A streamed completion read on a thread; `arrivals` times each chunk."""

    def __init__(self, port: int):
        self.text, self.arrivals, self.finish_reason, self.error = [], [], None, None
        self._response = post(port, "/v1/completions", {"model": "smollm2", "prompt": STREAM_PROMPT, "stream": True,
                                                        "max_tokens": STREAM_TOKENS, "temperature": 0,
                                                        "ignore_eos": True})
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for line in self._response:
                line = line.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if not event.get("choices"):   # an error event ends the stream early
                    self.error = event
                    return
                choice = event["choices"][0]
                self.text.append(choice["text"])
                self.arrivals.append(time.monotonic())
                self.finish_reason = choice.get("finish_reason") or self.finish_reason
        except Exception as e:  # reported by the test
            self.error = e


def test_the_charts_pods_run_from_the_image_serve_and_drain(tmp_path, offline):
    assert image_exists(cpu_image()), f"no image {cpu_image()}: `make image` builds it (make test-deploy does first)"
    names = ("router", "http", "kvstore", "kv_tcp", "prefill", "decode")
    ports = dict(zip(names, free_ports(len(names))))
    metrics = dict(zip(("kvstore", "prefill", "decode", "router"), free_ports(4)))
    api = EndpointSliceServer(NAMESPACE, tmp_path / "apiserver")
    per_component = {c: rendered(ports, m) for c, m in metrics.items()}
    manifests = per_component["router"]
    services = {c: f"{FULLNAME}-{c}" for c in ("kvstore", "prefill", "decode", "router")}
    for pool in ("prefill", "decode"):
        api.add_service(services[pool], ports[pool])
    cluster = Cluster(manifests, tuple(services.values()), api.account.folder, (api.host, api.port))
    pods = {}
    try:
        pods["kvstore"] = run_pod("pods-test-kvstore", pod_spec(per_component["kvstore"], "kvstore"), cluster,
                                  tmp_path / "kvstore")
        wait_started(pods["kvstore"])
        for pool in ("prefill", "decode"):
            pods[pool] = run_pod(f"pods-test-{pool}", pod_spec(per_component[pool], pool), cluster, tmp_path / pool)
        for pool in ("prefill", "decode"):
            wait_started(pods[pool])
            api.set_ready(services[pool], True)   # the readiness probe passed: the endpoint is ready
        pods["router"] = run_pod("pods-test-router", pod_spec(manifests, "router"), cluster, tmp_path / "router")
        wait_started(pods["router"])

        # the router's container finds both pools through the API server, with its pod's token
        deadline = time.monotonic() + 60
        while not any("endpointslices" in path and status == 200 for path, status in api.requests):
            assert time.monotonic() < deadline, f"no EndpointSlice list answered: {api.requests[-4:]}\n" \
                                                f"{pods['router'].logs()[-3000:]}"
            time.sleep(0.5)
        with pytest.raises(urllib.error.HTTPError) as refused:
            post(ports["http"], "/v1/chat/completions", {"model": "smollm2", "messages": MESSAGES}, key=None)
        assert refused.value.code == 401
        answer = json.loads(post(ports["http"], "/v1/chat/completions",
                                 {"model": "smollm2", "messages": MESSAGES, "max_tokens": 16, "temperature": 0}).read())
        assert answer["choices"][0]["message"]["content"] == offline["chat"]

        # scale-down of the decode pool while it streams: out of the EndpointSlice, preStop,
        # SIGTERM; the stream in flight still ends whole
        stream = Stream(ports["http"])
        deadline = time.monotonic() + 120
        while not stream.arrivals and time.monotonic() < deadline and stream.thread.is_alive():
            time.sleep(0.05)
        assert stream.arrivals, f"no token streamed: {stream.error}\n{pods['decode'].logs()[-3000:]}"
        terminate(pods["decode"], on_pre_stop=lambda: api.set_ready(services["decode"], False))
        stream.thread.join(timeout=120)
        assert stream.error is None, stream.error
        assert stream.finish_reason == "length" and "".join(stream.text) == offline["story"]
        assert stream.arrivals[-1] > pods["decode"].sigterm_at, "the stream ended before SIGTERM: it tested no drain"
        assert pods["decode"].state() == ("exited", 0), pods["decode"].logs()[-3000:]
        assert "SIGKILL" not in " ".join(pods["decode"].events)

        for component in ("router", "prefill", "kvstore"):   # the rest of the release, uninstalled
            terminate(pods[component])
            assert pods[component].state() == ("exited", 0), pods[component].logs()[-3000:]
            assert "SIGKILL" not in " ".join(pods[component].events)
    finally:
        for pod in pods.values():
            (tmp_path / f"{pod.name}.log").write_text(pod.logs())
            remove(pod)
        api.close()
