"""Cold start: process start to first token, for pdserve's engine and (optionally) vLLM-CPU.

Each engine runs in a fresh Python process that imports the engine, builds it on the
embedded SmolLM2, generates one token and prints when each phase ended, relative to the
moment the process was spawned. vLLM compiles its model at start (torch.compile), pdserve
builds nothing at run time (its C++ kernels are built by `make setup`), so this is also
where a user sees whether any request pays for compilation: the first request's own time
is reported apart from the start-up before it.

    .venv/bin/python -m bench.cold_start [--vllm-python $TMPDIR/vllm-peer/bin/python]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from bench.report import emit_result
from pdserve.engine.config import DEFAULT_MODEL

_PDSERVE = """
import time, json
t0 = float({t0!r})
from pdserve.engine import LLM, SamplingParams
imported = time.time()
llm = LLM({model!r}, progress=False)
built = time.time()
llm.generate({{"prompt_token_ids": [504, 3575, 282, 4649, 314]}}, SamplingParams(max_tokens=1, temperature=0))
first = time.time()
llm.generate({{"prompt_token_ids": [504, 3575, 282, 4649, 314]}}, SamplingParams(max_tokens=1, temperature=0))
second = time.time()
print("COLD " + json.dumps(dict(import_s=imported - t0, ready_s=built - t0, first_token_s=first - t0,
                                first_request_s=first - built, warm_request_s=second - first)))
"""

_VLLM = """
import os, time, json
t0 = float({t0!r})
for k, v in dict(HF_HUB_OFFLINE="1", VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="2",
                 VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_NO_USAGE_STATS="1").items():
    os.environ.setdefault(k, v)
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
imported = time.time()
llm = LLM(model={model!r}, dtype="float32", max_model_len=2048)
built = time.time()
p = [TokensPrompt(prompt_token_ids=[504, 3575, 282, 4649, 314])]
llm.generate(p, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
first = time.time()
llm.generate(p, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
second = time.time()
print("COLD " + json.dumps(dict(import_s=imported - t0, ready_s=built - t0, first_token_s=first - t0,
                                first_request_s=first - built, warm_request_s=second - first)))
"""


def run(python: str, template: str, model: str) -> dict:
    t0 = time.time()
    code = template.format(t0=t0, model=model)
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("COLD ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{python} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return {k: round(v, 2) for k, v in json.loads(lines[-1].removeprefix("COLD ")).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", default=None)
    parser.add_argument("--hf-dir", default=os.path.join(tempfile.gettempdir(), "pdserve-smollm2-hf"),
                        help="vLLM's copy of the model (bench/offline_throughput.py saves it)")
    args = parser.parse_args()
    result = {"pdserve": run(sys.executable, _PDSERVE, DEFAULT_MODEL)}
    if args.vllm_python:
        if not os.path.isfile(os.path.join(args.hf_dir, "config.json")):
            from pdserve.engine.model.source import resolve_model
            from bench.offline_throughput import save_hf_folder
            save_hf_folder(resolve_model(DEFAULT_MODEL).path, args.hf_dir)
        result["vllm"] = run(args.vllm_python, _VLLM, args.hf_dir)
    emit_result(result)


if __name__ == "__main__":
    main()
