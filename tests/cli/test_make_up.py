"""The README's first command, `make up`, as a newcomer runs it: from the clone, on the
embedded default model, until it says the platform is up; one chat completion through the
OpenAI API; then Ctrl-C, which a terminal sends to the whole foreground process group."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import urllib.request

from tests.cli.installed import REPO
from tests.cli.up_platform import Platform, up_ports

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 12


def chat_completion(port: int) -> dict:
    body = json.dumps({"model": "smollm2", "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def offline_chat() -> str:
    from pdserve.engine import LLM, SamplingParams
    llm = LLM(model="smollm2", dtype="float32")
    return llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))[0].text


def test_make_up_serves_a_chat_completion_and_stops_on_ctrl_c():
    ports = up_ports(2, http=True)
    up_args = (f"--port {ports['router']} --http-port {ports['http']} --kvstore-port {ports['kvstore']} "
               f"--worker-base-port {ports['workers']} --metrics-base-port {ports['metrics']}")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    proc = subprocess.Popen(["make", "up", f"UP_ARGS={up_args}"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    up = Platform(proc, ports)
    try:
        up.wait_for(r"^pdserve is up:", timeout_s=600)  # a stale .venv is set up again first
        answer = chat_completion(ports["http"])
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: make, pdserve and every process it started
        try:
            proc.wait(timeout=90)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    log = up.log()
    assert answer["choices"][0]["message"]["content"] == offline_chat()
    assert answer["model"] == "smollm2" and answer["usage"]["completion_tokens"] > 0
    up.wait_for("^pdserve stopped: every process it started has exited", timeout_s=5)
    # make reports a Ctrl-C as its own interrupt (130); a failing pdserve would add "Error N"
    assert proc.returncode in (0, 130, -signal.SIGINT), log
    assert "make: ***" not in log, log
    left = subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert left == [], f"processes left behind: {left}"
