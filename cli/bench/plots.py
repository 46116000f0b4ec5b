"""PNG plots of a run (matplotlib, Agg backend): latency CDFs (TTFT, TPOT, ITL, E2E) and
TTFT / ITL over the run's time with the arrival rate."""
from __future__ import annotations

import numpy as np

from pdserve.cli.bench.metrics import RequestRecord


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def latency_cdfs(records: list[RequestRecord], path: str, title: str = "") -> str:
    plt = _plt()
    ok = [r for r in records if r.ok]
    series = [("TTFT", [r.ttft_s for r in ok]), ("TPOT", [r.tpot_s for r in ok if r.tpot_s is not None]),
              ("ITL", [x for r in ok for x in r.itl_s]), ("E2E latency", [r.e2e_s for r in ok])]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    for ax, (name, values) in zip(axes, series):
        v = np.sort(np.asarray(values, dtype=float)) * 1000
        if v.size:
            ax.step(v, np.arange(1, v.size + 1) / v.size, where="post")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("share of requests (ITL: of gaps)")
    fig.suptitle(f"Latency CDFs {title}".strip())
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def timeline(records: list[RequestRecord], path: str, title: str = "") -> str:
    """TTFT at each request's send time, ITL at each token's arrival, and the arrival rate
    (gray bars, right axis)."""
    plt = _plt()
    ok = [r for r in records if r.ok]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    ax1.scatter([r.start_s for r in ok], [r.ttft_s * 1000 for r in ok], s=8, label="TTFT")
    ax1.set_ylabel("TTFT (ms)")
    xs = [r.start_s + t for r in ok for t in r.chunk_offsets_s[1:]]
    ys = [x * 1000 for r in ok for x in _chunk_itl(r)]
    ax2.scatter(xs, ys, s=2, color="tab:orange", label="ITL")
    ax2.set_ylabel("ITL (ms)")
    ax2.set_xlabel("time since start (s)")
    starts = [r.start_s for r in records]
    if starts:
        end = max([r.start_s + (r.e2e_s or 0.0) for r in records] + starts)
        width = max(end / 40, 0.05)  # about 40 bins, none shorter than 50 ms
        counts, edges = np.histogram(starts, bins=np.arange(0, end + width, width))
        for ax in (ax1, ax2):
            twin = ax.twinx()
            twin.bar(edges[:-1], counts / width, width=width, align="edge", alpha=0.15, color="gray")
            twin.set_ylabel("arrival rate (req/s)")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    fig.suptitle(f"TTFT and ITL over time {title}".strip())
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def _chunk_itl(r: RequestRecord) -> list[float]:
    t = r.chunk_offsets_s
    return [b - a for a, b in zip(t, t[1:])]
