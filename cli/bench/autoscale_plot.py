"""The plot of an autoscaling run (bench/autoscale_run.py): on one time axis, each pool's
replicas (asked for and serving), TTFT per request with the controller's metric and its
target, and the offered load (arrival rate) with requests in flight."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pdserve.cli.bench.metrics import RequestRecord
from pdserve.cli.bench.plots import _plt


@dataclass(frozen=True)
class PoolSample:
    """One controller decision, on the run's clock."""
    time_s: float
    pool: str
    current: int
    desired: int
    serving: int
    metric: float | None
    target: float


def autoscale_timeline(records: list[RequestRecord], samples: list[PoolSample], path: str, pool: str = "prefill",
                       title: str = "") -> str:
    plt = _plt()
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    mine = [s for s in samples if s.pool == pool]
    t = [s.time_s for s in mine]
    ax1.step(t, [s.desired for s in mine], where="post", label=f"{pool} replicas asked (HPA desired)")
    ax1.step(t, [s.serving for s in mine], where="post", label=f"{pool} workers serving", linestyle="--")
    ax1.set_ylabel("replicas")
    ax1.set_ylim(0, max([s.desired for s in mine] + [1]) + 1)
    ax1.legend(loc="upper right", fontsize=8)

    ok = [r for r in records if r.ok]
    ax2.scatter([r.start_s for r in ok], [r.ttft_s * 1000 for r in ok], s=6, alpha=0.5, label="TTFT per request")
    ax2.plot(t, [(s.metric or 0.0) * 1000 for s in mine], color="tab:red",
             label=f"{pool} metric (the HPA's per-pod quantile, mean over pods)")
    if mine:
        ax2.axhline(mine[0].target * 1000, color="black", linestyle=":", label="target")
    ax2.set_ylabel("TTFT (ms)")
    ax2.set_yscale("log")
    ax2.legend(loc="upper right", fontsize=8)

    starts = [r.start_s for r in records]
    if starts:
        end = max(max(t, default=0.0), max(starts))
        width = max(end / 60, 0.5)
        counts, edges = np.histogram(starts, bins=np.arange(0, end + width, width))
        ax3.bar(edges[:-1], counts / width, width=width, align="edge", alpha=0.4, color="gray",
                label="offered load (requests/s)")
        ends = [r.start_s + (r.e2e_s or 0.0) for r in records]
        grid = np.arange(0, end + width, width / 4)
        in_flight = [sum(s <= x < e for s, e in zip(starts, ends)) for x in grid]
        ax3.plot(grid, in_flight, color="tab:green", label="requests in flight")
    ax3.set_ylabel("load")
    ax3.set_xlabel("time since the burst started (s)")
    ax3.legend(loc="upper right", fontsize=8)
    for ax in (ax1, ax2, ax3):
        ax.grid(alpha=0.3)
    fig.suptitle(f"Autoscaling on the local platform {title}".strip())
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
