"""Issue 49 with real processes: `pdserve up --kvstore-backend mooncake` (it holds a token
of its own) against an attacker on the same host who has no token and uses Mooncake's own
client (tests/services/security/mooncake_thief.py):

(a) it reads every object of the plane and matches layer 0's V rows against the model's
    vocabulary (V does not depend on position): a salted prompt's tokens come back from
    plain KV, none from sealed KV;
(b) it replaces every object with plausible KV; after the workers restart (their own
    caches empty), the prompt sent again is answered exactly as the offline engine does,
    the forged blocks refused (`seal`) and counted.

Each runs against the control too: the same platform with the defence patched out of its
processes by a `sitecustomize` the test puts on their path (no key; and, as a forger able
to match the unkeyed checksum would, no checksum check): there the tokens come back and
the forged blocks are imported and change the answer.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

from pdserve.cli.bench.local_platform import free_port_range
from pdserve.engine import SamplingParams
from pdserve.services.router.client import RouterClient
from tests.cli.up_platform import running_up, scrape, up_ports

REPO = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SALT = "tenant-jane"
BLOCK_SIZE = 16
_UNSEALED = textwrap.dedent("""
    # the test's throwaway patch (tests/cli/test_up_kv_attacks.py): KV blocks unsealed and unchecked
    from pdserve.services.worker import kv_integrity, kv_seal
    kv_seal.KVKeys.from_token = classmethod(lambda cls, token: None)
    _refusal = kv_integrity.refusal
    def _unchecked(*args, **kwargs):
        reason = _refusal(*args, **kwargs)
        return None if reason in (kv_integrity.CHECKSUM, kv_integrity.SEAL) else reason
    kv_integrity.refusal = _unchecked
""")


@pytest.fixture(scope="module")
def prompt(tiny) -> list[int]:
    """A 70-token prompt (4 full blocks and a tail) of distinct token ids."""
    vocab = tiny.arch.vocab_size
    return [int(t) for t in torch.randperm(vocab - 10, generator=torch.Generator().manual_seed(49))[:70] + 5]


@pytest.fixture(scope="module")
def reference(tiny, tiny_llama_dir, prompt) -> list[int]:
    from pdserve.engine import LLM
    offline = LLM(tiny_llama_dir, loaded_model=tiny, progress=False, kv_cache_memory_bytes=64 << 20)
    return offline.generate({"prompt_token_ids": prompt}, GREEDY)[0].token_ids


@pytest.fixture(scope="module", params=["sealed", "control"])
def platform(request, tiny_llama_dir, tmp_path_factory):
    env = dict(os.environ)
    env.pop("PDSERVE_INTERNAL_TOKEN", None)  # up makes its own
    if request.param == "control":
        patch_dir = tmp_path_factory.mktemp("unsealed")
        (patch_dir / "sitecustomize.py").write_text(_UNSEALED)
        env["PYTHONPATH"] = os.pathsep.join([str(patch_dir), *filter(None, [env.get("PYTHONPATH")])])
    base = free_port_range(7)
    args = ["--prefill", "1", "--decode", "1", "--path-policy", "threshold", "--short-prompt-tokens", "8",
            "--kvstore-backend", "mooncake", "--kvstore-replicas", "1", "--kvstore-capacity-bytes", "64MiB",
            "--mooncake-base-port", str(base)]
    with running_up(tiny_llama_dir, up_ports(2), args, tmp_path_factory.mktemp(f"up-{request.param}"),
                    env=env) as up:
        up.mooncake = (f"127.0.0.1:{base}", f"http://127.0.0.1:{base + 1}/metadata", f"http://127.0.0.1:{base + 2}")
        up.sealed = request.param == "sealed"
        yield up


def _generate(platform, prompt) -> list[int]:
    with RouterClient(platform.router) as client:
        msgs = list(client.generate(prompt, GREEDY, cache_salt=SALT, timeout_s=90))
    return [t for m in msgs for t in m.token_ids]


def _thief(platform, mode: str, arg: str) -> int:
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_INTERNAL_TOKEN"}
    done = subprocess.run([sys.executable, "-m", "tests.services.security.mooncake_thief", mode, *platform.mooncake,
                           arg], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return int(done.stdout.split()[-1])


def _vocab_values(tiny_llama_dir) -> torch.Tensor:
    """Layer 0's V row of every token of the (public) model: [vocab, kv_heads * head_dim]."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32)
    layer = model.model.layers[0]
    with torch.no_grad():
        return layer.self_attn.v_proj(layer.input_layernorm(model.model.embed_tokens.weight))


def _recovered(objects: list[np.ndarray], values: torch.Tensor, block_shape: tuple[int, ...]) -> list[int]:
    """Every token id whose V row one of the objects holds (within 1% of its norm: the
    worker's kernels round otherwise than transformers')."""
    found = []
    for data in objects:
        if data.size != math.prod(block_shape) * 4:
            continue
        v0 = torch.from_numpy(data.view(np.float32).reshape(block_shape)[0, 1].reshape(block_shape[2], -1).copy())
        v0 = torch.nan_to_num(v0, nan=1e30, posinf=1e30, neginf=-1e30)
        dist, ids = torch.cdist(v0, values).min(dim=1)
        close = dist <= 1e-2 * values[ids].norm(dim=1).clamp_min(1e-6)
        found += ids[close].tolist()
    return found


def test_a_reader_of_the_plane_recovers_a_salted_prompt_only_without_the_seal(platform, prompt, reference, tiny,
                                                                              tiny_llama_dir, tmp_path):
    assert _generate(platform, prompt) == reference
    out = tmp_path / "objects.npz"
    assert _thief(platform, "read", str(out)) >= 4
    with np.load(out) as saved:
        objects = [saved[f"o{i}"] for i in range(len(saved["names"]))]
    arch = tiny.arch
    shape = (arch.num_layers, 2, BLOCK_SIZE, arch.num_kv_heads, arch.head_dim)
    found = set(_recovered(objects, _vocab_values(tiny_llama_dir), shape))
    in_full_blocks = set(prompt[:4 * BLOCK_SIZE])
    if platform.sealed:
        assert not found & set(prompt)
    else:  # the control: the attack works on plain KV
        assert len(found & in_full_blocks) >= 0.9 * len(in_full_blocks), (len(found & in_full_blocks), len(found))


def _kv_lines(url: str) -> str:
    """The worker's KV import and refusal samples (for a failure's message)."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return "\n".join(line for line in text.splitlines()
                     if not line.startswith("#") and ("rejected" in line or "imported" in line or "recompute" in line))


def _restart_workers(platform) -> None:
    mark = platform.mark()
    for name in ("prefill-0", "decode-0"):
        os.kill(platform.pid(name), 9)
    for name in ("prefill-0", "decode-0"):
        platform.wait_for(f"{name} serving again", 120, mark)
    router, deadline = platform.metrics_url("router"), time.monotonic() + 30
    while not all(scrape(router, "pdserve_router_workers_up", f'{{pool="{pool}"}}') == 1
                  for pool in ("prefill", "decode")):  # the router's poller has seen both back
        assert time.monotonic() < deadline, "the router did not see the restarted workers"
        time.sleep(0.1)


def test_forged_objects_are_refused_and_the_answer_stays_exact_only_with_the_seal(platform, prompt, reference):
    assert _generate(platform, prompt) == reference  # in the plane (again, or for the first time)
    assert _thief(platform, "forge", "7") >= 4
    _restart_workers(platform)
    prefill = platform.metrics_url("prefill-0")
    answer = _generate(platform, prompt)
    rejected = scrape(prefill, "pdserve_worker_kv_blocks_rejected_total", '{reason="seal"}')
    imported = scrape(prefill, "pdserve_kvstore_imported_tokens_total")
    seen = _kv_lines(prefill) + _kv_lines(platform.metrics_url("decode-0"))
    if platform.sealed:
        assert answer == reference
        assert rejected >= 1 and imported == 0, seen
    else:  # the control: the forgery is imported and answered with status OK
        assert imported >= 4 * BLOCK_SIZE and answer != reference
