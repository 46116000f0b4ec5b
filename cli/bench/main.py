"""`pdserve bench serve`: send a dataset's requests to a target on an arrival schedule,
then print the table and write the JSON and the plots.

In code: `result = run_bench(BenchConfig(...))` returns the summary, the records and the
paths written; `bench/serve_*.py` experiments use it against local clusters."""
from __future__ import annotations

import math
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, replace

from pdserve.cli.bench.arrivals import PROCESSES, ArrivalConfig, schedule
from pdserve.cli.bench.datasets import DATASETS, DISTRIBUTIONS, DatasetConfig, LengthDist, load_requests
from pdserve.cli.bench.metrics import SLO, RequestRecord, record_from, summarize
from pdserve.cli.bench.report import table, write_json
from pdserve.cli.bench.targets import BACKENDS, DEFAULT_URLS, Outcome, TargetConfig, make_target
from pdserve.cli.bench.worker_metrics import metrics_url, scrape_spec, spec_summary
from pdserve.services.router.fronts.http.config import API_KEY_ENV

MAX_IN_FLIGHT = 1024  # threads: the cap on requests in flight without --max-concurrency
SPEC_SETTLE_S = 0.25  # before reading the workers' counters after a run (_spec_after)


@dataclass(frozen=True)
class BenchConfig:
    target: TargetConfig = TargetConfig()
    dataset: DatasetConfig = DatasetConfig()
    arrivals: ArrivalConfig = ArrivalConfig()
    slo: SLO = SLO()
    label: str = "bench"
    result_dir: str | None = None   # writes <label>.json, <label>_cdf.png, <label>_timeline.png
    plots: bool = True
    progress: bool = True
    tokenizer: str | None = None    # an HF folder: ShareGPT lengths, and the vocab size over HTTP
    vocab_size: int | None = None   # for random token prompts (default: the router's, or the tokenizer's)
    worker_metrics: tuple[str, ...] = ()  # workers' /metrics URLs: the report adds what they counted


@dataclass
class BenchResult:
    summary: dict
    records: list[RequestRecord]
    target_info: dict
    requests: list = field(default_factory=list)  # the BenchRequests sent, in order
    files: dict = field(default_factory=dict)


def _tokenizer(path: str | None):
    if not path:
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def _drive(target, requests, offsets: list[float], max_concurrency: int | None, progress: bool,
           ) -> tuple[list[RequestRecord], float]:
    """Send request i at offsets[i] (later when max_concurrency, by default MAX_IN_FLIGHT,
    requests are in flight), each on its own thread; wait for all. Returns the records and
    the run's duration."""
    n = len(requests)
    records: list[RequestRecord | None] = [None] * n
    slots = threading.BoundedSemaphore(max_concurrency or MAX_IN_FLIGHT)
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=n, desc="requests", unit="req", file=sys.stderr, leave=False)
    lock = threading.Lock()
    start = time.perf_counter()

    def one(i: int) -> None:
        sent = time.perf_counter()
        try:
            out = target.send(requests[i])
        except Exception as e:  # a target's bug or an unexpected transport error: a failed request
            out = Outcome(sent=sent, error=f"{type(e).__name__}: {e}")
        try:
            records[i] = record_from(i, offsets[i], start, requests[i].output_len, out, time.perf_counter())
        finally:
            slots.release()
            if bar is not None:
                with lock:
                    bar.update(1)

    threads = []
    for i in range(n):
        delay = start + offsets[i] - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        slots.acquire()
        t = threading.Thread(target=one, args=(i,), name=f"bench-{i}", daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join()  # each request ends by its own timeout
    duration = time.perf_counter() - start
    if bar is not None:
        bar.close()
    missing = [i for i, r in enumerate(records) if r is None]
    if missing:
        raise RuntimeError(f"requests {missing[:5]} produced no record")
    return records, duration


def run_bench(cfg: BenchConfig, quiet: bool = False, requests: list | None = None) -> BenchResult:
    """`requests`: BenchRequests to send instead of the dataset's (a benchmark's own trace)."""
    out = None if quiet else sys.stdout
    target = make_target(cfg.target)
    try:
        try:
            info = target.describe()
        except Exception as e:  # grpc.RpcError, openai.APIError: the target is not there
            why = f"{e.code().name}: {e.details()}" if callable(getattr(e, "details", None)) else str(e)
            raise ValueError(f"{cfg.target.url}: cannot reach the {cfg.target.backend} target ({why})") from e
        tok = _tokenizer(cfg.tokenizer)
        vocab = cfg.vocab_size or info.get("vocab_size") or (len(tok) if tok is not None else None)
        if not vocab and cfg.dataset.name != "sharegpt":
            raise ValueError("the target does not report its vocabulary size: give --vocab-size or --tokenizer")
        dataset = replace(cfg.dataset, vocab_size=vocab) if vocab else cfg.dataset
        if requests is None:
            requests = load_requests(dataset, tok.encode if tok is not None else None)
        offsets = schedule(cfg.arrivals, len(requests), [r.arrival_s for r in requests])
        spec_before = scrape_spec(cfg.worker_metrics) if cfg.worker_metrics else None
        records, duration = _drive(target, requests, offsets, cfg.arrivals.max_concurrency, cfg.progress)
    finally:
        target.close()
    summary = summarize(records, duration, cfg.slo)
    if spec_before is not None:
        summary["spec_decode"] = _spec_after(cfg.worker_metrics, spec_before)
    result = BenchResult(summary, records, info, requests)
    if out is not None:
        print(table(summary, cfg.label), file=out)
    if cfg.result_dir:
        base = os.path.join(cfg.result_dir, cfg.label)
        result.files["json"] = write_json(base + ".json", {
            "label": cfg.label, "config": asdict(cfg), "target": info, "summary": summary,
            "requests": [r.to_json() for r in records]})
        if cfg.plots:
            from pdserve.cli.bench.plots import latency_cdfs, timeline
            result.files["cdf_png"] = latency_cdfs(records, base + "_cdf.png", cfg.label)
            result.files["timeline_png"] = timeline(records, base + "_timeline.png", cfg.label)
        if out is not None:
            print("wrote " + ", ".join(result.files.values()), file=out)
    return result


def _spec_after(urls: tuple[str, ...], before) -> dict:
    # a worker streams a step's tokens before it counts the step: the last one's counts
    # land just after the last answer does
    time.sleep(SPEC_SETTLE_S)
    try:
        return spec_summary(before, scrape_spec(urls))
    except ValueError as e:  # a worker gone during the run: the run's own results still stand
        return {"error": str(e)}


def add_arguments(p) -> None:
    g = p.add_argument_group("target")
    g.add_argument("--backend", choices=BACKENDS, default="grpc",
                   help="grpc: the router's Generate; openai: any OpenAI-compatible /v1/completions")
    g.add_argument("--url", default=None,
                   help=f"grpc: host:port (default {DEFAULT_URLS['grpc']}); "
                        f"openai: base URL (default {DEFAULT_URLS['openai']})")
    g.add_argument("--model", default="", help="openai: the model name (default: the first /v1/models lists)")
    g.add_argument("--api-key", default=os.environ.get(API_KEY_ENV, "unused"))
    g.add_argument("--slo-class", default="", help="the requests' SLO class (router)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--no-ignore-eos", action="store_true", help="let requests stop at EOS")
    g.add_argument("--request-timeout-s", type=float, default=600.0)
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset", choices=DATASETS, default="random")
    g.add_argument("--dataset-path", default=None, help="mooncake: JSONL trace; sharegpt: JSON file")
    g.add_argument("--num-requests", type=int, default=100)
    g.add_argument("--input-len", type=int, default=128, help="prompt tokens (shared-prefix: after the prefix)")
    g.add_argument("--input-dist", choices=DISTRIBUTIONS, default="fixed")
    g.add_argument("--input-spread", type=float, default=0.0,
                   help="uniform: +- this fraction of the mean; lognormal: sigma")
    g.add_argument("--output-len", type=int, default=64)
    g.add_argument("--output-dist", choices=DISTRIBUTIONS, default="fixed")
    g.add_argument("--output-spread", type=float, default=0.0)
    g.add_argument("--max-input-len", type=int, default=1 << 20)
    g.add_argument("--max-output-len", type=int, default=1 << 20)
    g.add_argument("--prefix-len", type=int, default=0, help="shared-prefix: system prompt tokens")
    g.add_argument("--num-prefixes", type=int, default=1, help="shared-prefix: distinct system prompts")
    g.add_argument("--prefix-seed", type=int, default=None,
                   help="shared-prefix: seed of the system prompts (default --seed), to reuse them across runs")
    g.add_argument("--trace-block-size", type=int, default=512, help="mooncake: tokens per hash id")
    g.add_argument("--sharegpt-output-len", type=int, default=None)
    g.add_argument("--tokenizer", default=None, help="HF folder: ShareGPT lengths; vocab size over HTTP")
    g.add_argument("--vocab-size", type=int, default=None)
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("arrivals")
    g.add_argument("--arrival", choices=PROCESSES, default="poisson",
                   help="poisson/constant at --request-rate; burst: on/off; trace: the dataset's timestamps")
    g.add_argument("--request-rate", type=float, default=math.inf,
                   help="req/s (inf: all at once); burst: the rate between bursts")
    g.add_argument("--burst-rate", type=float, default=0.0, help="burst: req/s while on")
    g.add_argument("--burst-on-s", type=float, default=1.0)
    g.add_argument("--burst-off-s", type=float, default=1.0)
    g.add_argument("--burst-constant", action="store_true", help="burst: evenly spaced instead of Poisson")
    g.add_argument("--trace-time-scale", type=float, default=1.0)
    g.add_argument("--max-concurrency", type=int, default=None)
    g = p.add_argument_group("report")
    g.add_argument("--slo-ttft-ms", type=float, default=None)
    g.add_argument("--slo-tpot-ms", type=float, default=None)
    g.add_argument("--label", default="bench")
    g.add_argument("--result-dir", default=None, help="write <label>.json and PNG plots here")
    g.add_argument("--no-plots", action="store_true")
    g.add_argument("--no-progress", action="store_true")
    g.add_argument("--worker-metrics", default="",
                   help="the workers' /metrics, comma-separated (host:port or URL; `pdserve up` prints them): the "
                        "report adds speculative decoding over the run (draft tokens proposed, accepted, "
                        "acceptance rate, mean accepted length)")


def config_from_args(args) -> BenchConfig:
    url = args.url or DEFAULT_URLS[args.backend]
    return BenchConfig(
        target=TargetConfig(backend=args.backend, url=url, model=args.model, api_key=args.api_key,
                            slo_class=args.slo_class, temperature=args.temperature,
                            ignore_eos=not args.no_ignore_eos, timeout_s=args.request_timeout_s),
        dataset=DatasetConfig(
            name=args.dataset, num_requests=args.num_requests,
            input_len=LengthDist(args.input_len, args.input_dist, args.input_spread, hi=args.max_input_len),
            output_len=LengthDist(args.output_len, args.output_dist, args.output_spread, hi=args.max_output_len),
            prefix_len=args.prefix_len, num_prefixes=args.num_prefixes, prefix_seed=args.prefix_seed,
            path=args.dataset_path,
            trace_block_size=args.trace_block_size, sharegpt_output_len=args.sharegpt_output_len, seed=args.seed),
        arrivals=ArrivalConfig(process=args.arrival, rate=args.request_rate, burst_rate=args.burst_rate,
                               on_s=args.burst_on_s, off_s=args.burst_off_s, burst_poisson=not args.burst_constant,
                               time_scale=args.trace_time_scale, max_concurrency=args.max_concurrency,
                               seed=args.seed),
        slo=SLO(ttft_s=math.inf if args.slo_ttft_ms is None else args.slo_ttft_ms / 1000,
                tpot_s=math.inf if args.slo_tpot_ms is None else args.slo_tpot_ms / 1000),
        label=args.label, result_dir=args.result_dir, plots=not args.no_plots, progress=not args.no_progress,
        tokenizer=args.tokenizer, vocab_size=args.vocab_size,
        worker_metrics=tuple(metrics_url(u.strip()) for u in args.worker_metrics.split(",") if u.strip()))


def run(args) -> int:
    result = run_bench(config_from_args(args))
    return 0 if result.summary["failed"] == 0 else 1


def main(argv: list[str] | None = None) -> int:
    import argparse
    p = argparse.ArgumentParser(prog="pdserve bench serve", description=__doc__.splitlines()[0])
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return run(args)
    except ValueError as e:
        print(f"pdserve bench serve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
