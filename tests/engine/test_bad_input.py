"""Every bad input gets a clear error naming its field or file, and disturbs nothing else."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from pdserve.engine import LLM, InvalidRequestError, ModelLoadError, SamplingParams
from pdserve.engine.model.loader import load_model
from pdserve.engine.model.source import resolve_model
from pdserve.engine.engine_request import EngineRequest


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    loaded = load_model(resolve_model(tiny_llama_dir), torch.float32, "cpu", progress=False)
    return LLM(tiny_llama_dir, loaded_model=loaded, progress=False, max_model_len=256)


@pytest.mark.parametrize("kwargs,field", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-2), "top_k"),
    (dict(min_p=2.0), "min_p"), (dict(seed=-1), "seed"), (dict(stop=[""]), "stop"),
    (dict(max_tokens="8"), "max_tokens"), (dict(logprobs=-1), "logprobs"),
])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.field == field and field in str(e.value)


@pytest.mark.parametrize("prompt,field", [
    ("", "prompt"), ({"prompt_token_ids": []}, "prompt"), ({"prompt_token_ids": [1, -3]}, "prompt_token_ids"),
    ({"prompt_token_ids": [10**9]}, "prompt_token_ids"), ({"prompt_token_ids": [5] * 256}, "prompt"), (42, "prompt"),
])
def test_bad_prompts_name_the_field(llm, prompt, field):
    with pytest.raises(InvalidRequestError) as e:
        llm.generate(prompt, SamplingParams(max_tokens=2))
    assert e.value.field == field


def test_request_level_limits(llm):
    with pytest.raises(InvalidRequestError, match="logprobs"):
        llm.generate("hi", SamplingParams(logprobs=50))
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        llm.generate("hi", SamplingParams(stop_token_ids=[10**9]))
    with pytest.raises(InvalidRequestError, match="sampling_params"):
        llm.generate(["a", "b"], [SamplingParams()])


def test_bad_request_does_not_disturb_running_ones(llm):
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    expected = llm.generate("steady", params)[0].token_ids
    engine.add_request(EngineRequest("good", llm.tokenizer.encode("steady"), params))
    engine.step()
    with pytest.raises(InvalidRequestError):
        engine.add_request(EngineRequest("bad", [], params))
    with pytest.raises(InvalidRequestError, match="req_id"):
        engine.add_request(EngineRequest("good", [1, 2], params))
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert [o.req_id for o in outs] == ["good"] and outs[0].token_ids == expected


def test_abort_mid_run_frees_every_block(llm):
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    for i in range(3):
        engine.add_request(EngineRequest(f"a{i}", list(range(3, 40 + 10 * i)), params))
    for _ in range(3):
        engine.step()
    engine.abort_request("a1")
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.req_id] = o
        if "a0" not in outs:
            engine.abort_request("a2")
    assert outs["a1"].finish_reason == "abort" and outs["a2"].finish_reason == "abort"
    assert outs["a0"].finish_reason == "length"
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.pool.num_blocks


def test_unknown_model_and_corrupt_files(tmp_path, tiny_llama_dir):
    with pytest.raises(ModelLoadError, match="no-such-model"):
        LLM("no-such-model", progress=False)
    bad_gguf = tmp_path / "broken.gguf"
    bad_gguf.write_bytes(b"GGUF" + os.urandom(64))
    with pytest.raises(ModelLoadError, match="broken.gguf"):
        LLM(str(bad_gguf), progress=False)
    folder = tmp_path / "corrupt"
    shutil.copytree(tiny_llama_dir, folder)
    (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json" + b"0" * 64)
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        LLM(str(folder), progress=False)


def test_cli_errors_exit_nonzero_without_traceback(tmp_path):
    cmd = [sys.executable, "-m", "pdserve.cli.main", "generate", "--prompt", "hi"]
    for extra, needle in [(["--model", str(tmp_path / "nope")], "nope"), (["--temperature", "-1"], "temperature"),
                          (["--max-tokens", "0"], "max_tokens")]:
        proc = subprocess.run(cmd + extra, capture_output=True, text=True, timeout=120)
        assert proc.returncode != 0
        assert needle in proc.stderr and "Traceback" not in proc.stderr


def test_cli_generate_prints_text_and_json(tiny_llama_dir):
    cmd = [sys.executable, "-m", "pdserve.cli.main", "generate", "--model", tiny_llama_dir, "--prompt", "hello",
           "--max-tokens", "5"]
    text = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout
    import json
    record = json.loads(subprocess.run(cmd + ["--json"], capture_output=True, text=True, timeout=120,
                                       check=True).stdout)
    assert record["text"] + "\n" == text
    assert len(record["token_ids"]) <= 5 and record["finish_reason"] in ("stop", "length")
