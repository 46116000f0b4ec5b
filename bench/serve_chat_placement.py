"""Issue 13, KV-aware placement: multi-turn chat placed by the prefix each worker holds
(`--placement kv`, the default), by the first 16 tokens' hash (`affinity`, the placement
before it) and by load alone (`least_loaded`).

The workload (cli/bench/datasets.py `chat_conversations`): --conversations chats run at
once, each of --turns turns; every conversation opens with the same system prompt, and
each turn's prompt is the whole conversation so far (the answers the model really gave
included) plus a new user message. A conversation sends its next turn when the previous
answer is complete. Under first-16-token affinity every chat request names the same
worker (the shared system prompt), so chat piles onto one prefill worker until load
overrides it; under least-loaded a conversation's turns scatter and its history is
recomputed (or imported from the kvstore) wherever it lands.

Each placement runs on a fresh `pdserve up` platform of real processes (cli/bench/
local_platform.py), one core per worker:

- `--topology disagg` (default): 2 prefill + 1 decode workers, every prompt through the
  prefill pool (threshold paths, --short-prompt-tokens below the shortest prompt);
- `--topology colocated`: 2 decode workers, no prefill pool: each prefills its own prompts.

Prints one JSON line: per placement the prefix-cache hit rate of the workers that
prefill (hit tokens / looked-up tokens, from their /metrics), the tokens they imported
from the kvstore, the reuse rate (prompt tokens not computed, locally cached or imported:
the requests' usage.cached_prompt_tokens), the reused prompt tokens by tier (the device
prefix cache, the host tier of --kv-offloading-size, the kvstore: which since issue 32 also
holds each finished turn's answer, written by the decode worker), TTFT mean/p50/p90 (client
side), requests per worker, and the router's placement decisions by reason.

    .venv/bin/python -m bench.serve_chat_placement [--topology disagg --placements kv,affinity,least_loaded
        --conversations 8 --turns 4 --system-len 512 --user-len 64 --output-len 32]
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import threading
import time
import urllib.request

import numpy as np

from prometheus_client.parser import text_string_to_metric_families

from bench.report import emit_row, emit_result
from pdserve.cli.bench.datasets import ChatConfig, LengthDist, chat_conversations, chat_history
from pdserve.cli.bench.local_platform import local_platform
from pdserve.cli.launcher import PlatformConfig
from pdserve.engine import SamplingParams
from pdserve.engine.config import DEFAULT_MODEL
from pdserve.services.router.client import RouterClient

TOPOLOGIES = {"disagg": (2, 1), "colocated": (0, 2)}


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """Every sample of one /metrics page: (name, sorted labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _sum(samples: dict, name: str, **labels) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


def run_conversation(client: RouterClient, conv, turns: list, errors: list, lock: threading.Lock) -> None:
    """Each turn after the previous answer is complete; appends (TTFT s, prompt tokens,
    cached prompt tokens) per turn to `turns`."""
    history: tuple[int, ...] = ()
    for turn, output_len in enumerate(conv.output_lens):
        prompt = conv.prompt(history, turn)
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        sent, first, answer, cached = time.perf_counter(), None, [], 0
        try:
            for msg in client.generate(list(prompt), params, timeout_s=600):
                if msg.token_ids and first is None:
                    first = time.perf_counter()
                answer.extend(msg.token_ids)
                if msg.finish_reason:  # usage: prompt tokens reused, locally or from the kvstore
                    cached = msg.usage.cached_prompt_tokens
        except Exception as e:  # grpc.RpcError: the conversation ends here, counted as failed
            with lock:
                errors.append(f"{type(e).__name__}: {e}")
            return
        with lock:
            turns.append(((first or time.perf_counter()) - sent, len(prompt), cached))
        history = chat_history(prompt, answer)


def run_placement(placement: str, args, conversations) -> dict:
    num_prefill, num_decode = TOPOLOGIES[args.topology]
    cfg = PlatformConfig(model=args.model, num_prefill=num_prefill, num_decode=num_decode, cpus_per_worker=1,
                         http_port=None, path_policy="threshold", short_prompt_tokens=args.short_prompt_tokens,
                         router_args=("--placement", placement, *shlex.split(args.router_args)),
                         worker_args=tuple(shlex.split(args.worker_args)))
    log = os.path.join(args.result_dir, f"{args.topology}-{placement}.log")
    with local_platform(cfg, log) as p:
        p.warm_up()
        specs = {s.name: s for s in p.platform.specs}
        prefilling = [n for n in specs if n.startswith("prefill-" if num_prefill else "decode-")]
        before = {n: scrape(specs[n].metrics_port) for n in prefilling}
        turns, errors, lock = [], [], threading.Lock()
        start = time.perf_counter()
        with RouterClient(p.router_address) as client:
            threads = [threading.Thread(target=run_conversation, args=(client, c, turns, errors, lock))
                       for c in conversations]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        duration = time.perf_counter() - start
        after = {n: scrape(specs[n].metrics_port) for n in prefilling}
        router = scrape(specs["router"].metrics_port)
    return summarize(prefilling, before, after, router, turns, errors, duration)


def summarize(workers, before, after, router, turns, errors, duration) -> dict:
    def delta(name, n, **labels):
        return _sum(after[n], name, **labels) - _sum(before[n], name, **labels)
    queried = sum(delta("pdserve_prefix_cache_queried_tokens", n) for n in workers)
    hits = sum(delta("pdserve_prefix_cache_hit_tokens", n) for n in workers)
    host_hits = int(sum(delta("pdserve_prefix_cache_host_hit_tokens", n) for n in workers))
    imported = int(sum(delta("pdserve_kvstore_imported_tokens_total", n) for n in workers))
    t = np.array([ttft for ttft, _, _ in turns]) * 1000 if turns else np.zeros(1)
    num_prompt, num_cached = sum(n for _, n, _ in turns), sum(c for _, _, c in turns)
    # what the prefilling workers reused of the prompts, by where it came from
    tiers = {"device": int(hits), "host": host_hits, "kvstore": imported}
    reasons = {dict(ls)["reason"]: v for (n, ls), v in router.items()
               if n == "pdserve_router_placement_total" and v and dict(ls).get("pool") == ("prefill" if any(
                   w.startswith("prefill") for w in workers) else "decode")}
    return {"turns_completed": len(turns), "errors": errors[:3], "duration_s": round(duration, 1),
            "prefix_hit_rate": round(hits / queried, 3) if queried else 0.0,
            "kvstore_imported_tokens": imported,
            "reused_tokens_by_tier": tiers,
            "reused_share_by_tier": {k: round(v / num_prompt, 3) if num_prompt else 0.0 for k, v in tiers.items()},
            # reused either way, the worker's own cache or the kvstore's (the requests' usage)
            "reuse_rate": round(num_cached / num_prompt, 3) if num_prompt else 0.0,
            "ttft_ms": {"mean": round(float(t.mean())), "p50": round(float(np.percentile(t, 50))),
                        "p90": round(float(np.percentile(t, 90)))},
            "requests_per_worker": {n: int(delta("pdserve_worker_requests_total", n, outcome="ok")) for n in workers},
            "placement_reasons": reasons}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--topology", choices=TOPOLOGIES, default="disagg")
    p.add_argument("--placements", default="kv,affinity,least_loaded")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-len", type=int, default=512)
    p.add_argument("--user-len", type=int, default=64, help="mean; uniform within +-50%%")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--short-prompt-tokens", type=int, default=64,
                   help="threshold paths: below the shortest prompt, so every turn goes through the prefill pool")
    p.add_argument("--router-args", default="", help="more router flags, one string (e.g. '--kv-store-weight 0.8')")
    p.add_argument("--worker-args", default="",
                   help="more worker flags, one string (e.g. '--kv-cache-memory-bytes 16777216': a cache "
                        "smaller than the conversations, where one worker's cache cannot hold them all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-dir", default="/tmp/pdserve-bench/chat_placement")
    args = p.parse_args()
    os.makedirs(args.result_dir, exist_ok=True)
    conversations = chat_conversations(ChatConfig(
        num_conversations=args.conversations, num_turns=args.turns, system_len=args.system_len,
        user_len=LengthDist(args.user_len, "uniform", 0.5, lo=1), output_len=LengthDist(args.output_len),
        seed=args.seed))
    out = {"model": args.model, "topology": args.topology, "conversations": args.conversations,
           "turns": args.turns, "system_len": args.system_len, "user_len": args.user_len,
           "output_len": args.output_len, "router_args": args.router_args, "worker_args": args.worker_args, "cpus": len(os.sched_getaffinity(0))}
    for placement in args.placements.split(","):
        out[placement] = run_placement(placement, args, conversations)
        emit_row({placement: out[placement]}, sys.stderr)
    emit_result(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
