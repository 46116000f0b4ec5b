"""pd_up_one_gpu: `pdserve up` with one prefill and one decode worker on the one GPU, every
request handed over, against the offline engine."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

from bench.gpu_check.context import Ctx, free, make_llm
from bench.gpu_check.greedy import agreement_text, compare_greedy, greedy_with_logprobs
from bench.gpu_check.processes import ROOT, child_env, kill_group


def run(ctx: Ctx):
    """`python -m pdserve.cli.main up --prefill 1 --decode 1` with both workers on ctx's device, the
    threshold path policy at 0 direct-path tokens (every request through the prefill worker and
    the kvstore), greedy requests one at a time, against the offline engine run one prompt at a
    time (the same batch-1 shapes)."""
    import random

    from pdserve.engine import SamplingParams
    from pdserve.engine.model.loader import read_arch
    from pdserve.engine.model.source import resolve_model
    from pdserve.services.router.client import RouterClient
    from tests.cli.up_platform import Platform, up_ports
    vocab = read_arch(resolve_model(ctx.model)).vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in ((40, 129, 300, 511) if ctx.cuda else (20, 40))]
    new_tokens = 16 if ctx.cuda else 6
    kv_bytes = (1 << 30) if ctx.cuda else (64 << 20)
    llm = make_llm(ctx, kv_cache_memory_bytes=kv_bytes)
    offline = [greedy_with_logprobs(llm, [p], new_tokens) for p in prompts]
    del llm
    free()
    ports = up_ports(2)
    cmd = [sys.executable, "-m", "pdserve.cli.main", "up", "--model", ctx.model, "--prefill", "1", "--decode", "1",
           "--port", str(ports["router"]), "--kvstore-port", str(ports["kvstore"]), "--http-port", "off",
           "--worker-base-port", str(ports["workers"]), "--metrics-base-port", str(ports["metrics"]),
           "--path-policy", "threshold", "--short-prompt-tokens", "0",
           "--worker-args", f"--device {ctx.device} --attention-backend {ctx.backend} --dtype bfloat16 "
                            f"--kv-cache-memory-bytes {kv_bytes}"]
    print("starting:", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            cwd=ROOT, env=child_env({"PDSERVE_LOG_LEVEL": "WARNING"}))
    ctx.record_session(proc.pid)
    up = Platform(proc, ports)
    start = time.monotonic()
    got, finish = [], []
    try:
        up.wait_for("pdserve is up", timeout_s=110 if ctx.cuda else 600)
        up_s = time.monotonic() - start
        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        with RouterClient(up.router) as client:
            for p in prompts:
                generation = client.generate_text(p, params, timeout_s=60 if ctx.cuda else 300)
                got.append(generation.token_ids)
                finish.append(generation.finish_reason)
        handed_over = up.metric(3, "pdserve_router_path_decisions_total", '{path="disaggregated",reason="long_prompt"}')
        prefilled = up.metric(1, "pdserve_worker_requests_total", '{outcome="ok"}')
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            kill_group(proc.pid)
            proc.wait()
        print(up.log(), flush=True)
    ref = [o[0][0] for o in offline]
    c = compare_greedy(ref, [o[1][0] for o in offline], got)
    ok = not c["not_near_ties"] and handed_over >= len(prompts) and prefilled >= len(prompts) \
        and all(f == "length" for f in finish)
    detail = (f"{agreement_text(c, f'requests x {new_tokens} tokens')} vs the offline engine; "
              f"{handed_over:.0f}/{len(prompts)} handed over (router), {prefilled:.0f} prefilled (prefill worker); "
              f"up in {up_s:.0f} s")
    if any(f != "length" for f in finish):
        detail += f"; finish reasons {finish}"
    return ("PASS" if ok else "FAIL"), detail, {**c, "router_tokens": got, "offline_tokens": ref,
                                                "handed_over": handed_over, "prefilled": prefilled, "up_s": up_s}
