"""Structured outputs end to end (issue 15's check): the real SmolLM2 behind a real
`pdserve up` (kvstore, 1 prefill, 1 decode, router with its OpenAI API, each a process on
loopback), driven by the official `openai` client.

20 chat requests under a JSON schema (a nested object, an enum, an integer range, an
array): every reply parses and validates with `jsonschema`. Half the prompts are longer
than the router's short-prompt threshold, so the grammar's first token is sampled on the
prefill worker and the decode worker continues its matcher after the KV hand-off through
the kvstore; the router's path counter proves that they took that path. A regex and a
choice request (vLLM's `structured_outputs` extra body) reply with a match.

The decode worker speculates (n-gram, issue 16): guided drafts are checked against the
grammar, and unguided greedy completions on both paths equal the offline engine's
without speculation.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from pdserve.cli.bench.local_platform import free_port_range
from pdserve.cli.bench.worker_metrics import scrape_path_decisions

SHORT_PROMPT_TOKENS = 96  # the threshold path policy: longer prompts go prefill -> kvstore -> decode
MAX_TOKENS = 96           # the schema's bounds close every reply well within it
ROLES = ["engineer", "doctor", "teacher", "artist", "pilot"]
SPECULATIVE_CONFIG = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "role": {"type": "string", "enum": ROLES},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
                    "required": ["city"], "additionalProperties": False},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 2},
    },
    "required": ["name", "age", "role", "address", "skills"],
    "additionalProperties": False,
}
# ~150 prompt tokens with the chat template: over SHORT_PROMPT_TOKENS
BACKGROUND = ("The registry below lists the staff of a small coastal town: the harbour master, the "
              "school's teachers, the clinic's doctors, the two pilots of the ferry service and the "
              "painters who rent the old warehouse by the pier. Each entry gives a name, an age, a "
              "role, the city they live in and a couple of skills, and nothing else. ") * 2


def _prompt(i: int) -> str:
    ask = f"Invent person number {i}, a {ROLES[i % len(ROLES)]}, as a JSON object."
    return BACKGROUND + ask if i % 2 else ask


class UpProcess:
    """`pdserve up` as a child process, its output collected line by line."""

    def __init__(self, cmd: list[str]):
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True, env=dict(os.environ, PDSERVE_LOG_LEVEL="WARNING"))
        self.lines: list[str] = []
        self._up = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith("pdserve is up"):
                self._up.set()

    def wait_up(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self._up.wait(0.5):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise AssertionError("pdserve up did not come up:\n" + "".join(self.lines[-80:]))

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


@pytest.fixture(scope="module")
def up(smollm2_path):
    grpc_base, http_port, metrics_base = free_port_range(4), free_port_range(1), free_port_range(4)
    cmd = [sys.executable, "-m", "pdserve.cli.main", "up", "--model", smollm2_path, "--prefill", "1", "--decode", "1",
           "--port", str(grpc_base), "--kvstore-port", str(grpc_base + 1), "--worker-base-port", str(grpc_base + 2),
           "--http-port", str(http_port), "--metrics-base-port", str(metrics_base),
           "--path-policy", "threshold", "--short-prompt-tokens", str(SHORT_PROMPT_TOKENS),
           "--speculative-config", json.dumps(SPECULATIVE_CONFIG)]
    platform = UpProcess(cmd)
    try:
        platform.wait_up(timeout_s=180)
        platform.http_port = http_port
        yield platform
    finally:
        platform.stop()
    left = subprocess.run(["pgrep", "-s", str(platform.proc.pid)], capture_output=True, text=True).stdout.split()
    assert left == [], f"processes left behind: {left}"


@pytest.fixture(scope="module")
def client(up) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{up.http_port}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def _path_decisions(up, path: str) -> float:
    """The router's requests that took `path`, summed over reasons, from its /metrics."""
    decisions = scrape_path_decisions(f"http://127.0.0.1:{up.http_port}/metrics")
    return sum(n for key, n in decisions.items() if key.startswith(f"{path}/"))


def _chat(client, model: str, content: str, **kwargs) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                          max_tokens=MAX_TOKENS, temperature=0, **kwargs)


def test_json_schema_replies_validate_on_both_paths(up, client, model):
    before = _path_decisions(up, "disaggregated"), _path_decisions(up, "direct")
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    with ThreadPoolExecutor(20) as pool:  # all at once: one batch on each worker
        replies = list(pool.map(lambda i: _chat(client, model, _prompt(i), response_format=response_format), range(20)))
    for i, reply in enumerate(replies):
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", (i, choice)
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    assert replies[1].usage.prompt_tokens > SHORT_PROMPT_TOKENS >= replies[0].usage.prompt_tokens
    after = _path_decisions(up, "disaggregated"), _path_decisions(up, "direct")
    assert after[0] - before[0] >= 1, "no request took the prefill -> kvstore -> decode path"
    assert after[1] - before[1] >= 1, "no request took the direct path"


def test_regex_reply_matches(client, model):
    pattern = r"[A-Z][a-z]{2,8}-[0-9]{3}"
    reply = _chat(client, model, "Give a code name for the ferry, like Alpha-123.",
                  extra_body={"structured_outputs": {"regex": pattern}})
    assert re.fullmatch(pattern, reply.choices[0].message.content), reply.choices[0].message.content


def test_choice_reply_is_one_of_the_choices(client, model):
    choices = ["sunny", "rainy", "foggy"]
    reply = _chat(client, model, "What is the weather like by the sea in autumn? " + BACKGROUND,
                  extra_body={"structured_outputs": {"choice": choices}})
    assert reply.choices[0].message.content in choices


def _decode_counter(up, name: str) -> float:
    url = next(re.search(r"metrics (http://\S+/metrics)", line).group(1) for line in up.lines
               if re.match(r"^\s+decode\S*\s+grpc ", line))
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    match = re.search(rf"^{name} (\S+)$", text, re.M)
    assert match, f"the decode worker's /metrics has no {name}"
    return float(match.group(1))


def test_speculating_decode_worker_gives_the_offline_greedy_text(up, client, model, smollm2_loaded):
    from pdserve.engine import LLM, SamplingParams
    listing = "apples, pears, plums, apples, pears, plums, apples, pears, plums, apples, pears"
    prompts = ["Repeat exactly: " + listing, BACKGROUND + "Repeat the registry's first sentence exactly:"]
    offline = LLM("smollm2", loaded_model=smollm2_loaded, progress=False, kv_cache_memory_bytes=64 << 20)
    expected = [o.text for o in offline.generate(prompts, SamplingParams(temperature=0, max_tokens=40))]
    before = _decode_counter(up, "pdserve_worker_spec_accepted_tokens_total")
    got = [client.completions.create(model=model, prompt=p, max_tokens=40, temperature=0).choices[0].text
           for p in prompts]
    assert got == expected
    assert _decode_counter(up, "pdserve_worker_spec_accepted_tokens_total") > before  # drafts were kept
