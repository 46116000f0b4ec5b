"""A worker's per-step costs, as the simulator reads them: prefill step time by tokens,
decode step time by batch size and context, KV put/get time by bytes, and the scheduler
limits of the worker it describes. Piecewise-linear interpolation between the measured
points (linear extrapolation past the last), so a profile is a few small tables.

A step (prefill chunks n_1..n_k and b decodes together, as the engine runs them) costs

    step_s = f + sum_i (prefill(n_i) - f) + (prefill(b) - f) + max(0, decode(b, c) - decode(b, c_min))

where f = prefill(0), the table's intercept: what any step pays once (on a CPU, reading
the weights). Each chunk adds what it adds alone, because attention is per sequence: a
step of three 400-token prompts costs three 400-token steps less two fixed parts, not a
1200-token prompt's quadratic attention (measured here: 6.9 s against 3 x 2.3 s - 0.2 s,
where the total-tokens reading of the table said 8.7 s). The decodes ride in the flat batch
as b more tokens, plus the attention over their context beyond the shortest measured one
(the part a prefill table does not hold). A chunk is costed as a fresh prompt of its length:
the attention over a chunked prompt's earlier chunks is not counted.

Workers that share a host (the cluster's `workers_per_host`) slow each other down: a step
runs `neighbour_prefill_factor` (`neighbour_decode_factor`) times as long while another
worker there steps too (profiler/calibrate.py measures both on a running platform).

`source` says where the numbers come from: "measured on <host> ..." (`pdserve profile`)
or "hand-written from published numbers: <reference>".
"""
from __future__ import annotations

import bisect
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

from pdserve.engine.config import CacheConfig, SchedulerConfig


@dataclass(frozen=True)
class Table1D:
    xs: tuple[float, ...]
    ys: tuple[float, ...]

    def __post_init__(self):
        if len(self.xs) < 1 or len(self.xs) != len(self.ys) or list(self.xs) != sorted(set(self.xs)):
            raise ValueError(f"table: needs increasing distinct xs and as many ys, got {self.xs} / {self.ys}")

    def __call__(self, x: float) -> float:
        xs, ys = self.xs, self.ys
        if len(xs) == 1:
            return ys[0] * (x / xs[0] if xs[0] else 1.0)
        i = min(max(bisect.bisect_right(xs, x) - 1, 0), len(xs) - 2)
        x0, x1 = xs[i], xs[i + 1]
        y = ys[i] + (ys[i + 1] - ys[i]) * (x - x0) / (x1 - x0)
        return max(y, 0.0)


@dataclass(frozen=True)
class SchedulerLimits:
    """The engine settings the profile was measured with. The defaults are the engine's own
    (engine/config.py), so a profile that leaves them out describes a worker with default
    flags, and a changed engine default cannot leave a stale copy here."""
    max_num_seqs: int = SchedulerConfig.max_num_seqs
    max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens
    long_prefill_token_threshold: int = SchedulerConfig.long_prefill_token_threshold
    block_size: int = CacheConfig.block_size
    # the engine sizes its pool from the memory it finds; this one is the profile's own
    num_kv_blocks: int = 4096


@dataclass(frozen=True)
class Profile:
    source: str
    model: str
    prefill: Table1D                       # tokens in one step -> s (up to the threshold: one prompt)
    decode_batch_sizes: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    decode_s: tuple[tuple[float, ...], ...]  # [batch i][context j] -> s per step
    kv_put: Table1D                        # bytes -> s (the prefill worker's write)
    kv_get: Table1D                        # bytes -> s (the decode worker's read)
    kv_bytes_per_token: int
    scheduler: SchedulerLimits = SchedulerLimits()
    request_overhead_s: float = 0.0        # fixed per call (gRPC, router): added to TTFT
    # what a serving worker's step costs beyond engine.step(): handing the outputs to their
    # streams, gRPC sending them from the same cores, metrics; measured on a running platform
    step_overhead_s: float = 0.0
    # the part of a KV put / get that runs on the worker's own cores, stretching its steps:
    # 1 where the transfer is the worker's CPU work (gRPC + copies, as on this host), 0 where
    # a NIC moves the bytes (RDMA, NIXL)
    kv_cpu_share: float = 0.0
    # what the hand-off from prefill to decode costs beyond moving the bytes: the router's
    # call to the decode worker, its KV lookup and the import into its cache; measured on a
    # running platform, added before the decode's read
    handoff_overhead_s: float = 0.0
    # how many times as long a step runs while another worker on the same host steps too, by
    # the step's kind (one with prefill chunks, or decodes only): the shared cache and memory
    # bus, and on a CPU host the router's, kvstore's and gRPC's threads taking the same
    # cores; 1 where each worker has its own device. The cluster applies them only to
    # workers it places on one host (ClusterConfig.workers_per_host).
    neighbour_prefill_factor: float = 1.0
    neighbour_decode_factor: float = 1.0

    def __post_init__(self):
        for name in ("request_overhead_s", "step_overhead_s", "handoff_overhead_s"):
            if not getattr(self, name) >= 0.0:
                raise ValueError(f"profile: field '{name}' must be >= 0, got {getattr(self, name)}")
        for name in ("neighbour_prefill_factor", "neighbour_decode_factor"):
            if not getattr(self, name) >= 1.0:
                raise ValueError(f"profile: field '{name}' must be >= 1 (a neighbour does not speed a step "
                                 f"up), got {getattr(self, name)}")
        if not 0.0 <= self.kv_cpu_share <= 1.0:
            raise ValueError(f"profile: field 'kv_cpu_share' must be in [0, 1], got {self.kv_cpu_share}")
        if len(self.decode_s) != len(self.decode_batch_sizes) or any(
                len(row) != len(self.decode_contexts) for row in self.decode_s):
            raise ValueError("profile: field 'decode.seconds' must be a batch_sizes x contexts table")
        # per context, a table over batch sizes (bilinear interpolation = two 1-D steps)
        rows = [Table1D(tuple(map(float, self.decode_batch_sizes)), tuple(self.decode_s[i][j]
                        for i in range(len(self.decode_batch_sizes)))) for j in range(len(self.decode_contexts))]
        object.__setattr__(self, "_by_context", rows)

    def prefill_s(self, num_tokens: int) -> float:
        return self.prefill(num_tokens)

    def decode_step_s(self, batch: int, context: float) -> float:
        ctxs, rows = self.decode_contexts, self._by_context
        at = [row(batch) for row in rows]
        return Table1D(tuple(map(float, ctxs)), tuple(at))(context) if len(ctxs) > 1 else at[0]

    def step_s(self, prefill_chunks: Sequence[int], num_decodes: int, mean_context: float) -> float:
        """A serving worker's step: the engine's, plus step_overhead_s."""
        if not prefill_chunks:
            return self.decode_step_s(num_decodes, mean_context) + self.step_overhead_s if num_decodes else 0.0
        fixed = self.prefill_s(0)
        seconds = fixed + sum(self.prefill_s(n) - fixed for n in prefill_chunks)
        if num_decodes:
            seconds += self.prefill_s(num_decodes) - fixed + max(
                0.0, self.decode_step_s(num_decodes, mean_context)
                - self.decode_step_s(num_decodes, self.decode_contexts[0]))
        return seconds + self.step_overhead_s

    def neighbour_factor(self, has_prefill: bool) -> float:
        return self.neighbour_prefill_factor if has_prefill else self.neighbour_decode_factor

    def scaled(self, prefill: float, decode: float, kv: float = 1.0) -> "Profile":
        """The same profile on a machine running `prefill` (`decode`) times as long a
        prefill (decode) step and `kv` times as long a KV transfer: a profile taken earlier,
        brought to where the machine's speed stands now (this VM drifts by tens of percent
        over hours), and to the platform's transfers (the profile's kvstore runs in its own
        process's threads; a platform's is one more process on the same cores)."""
        if not (prefill > 0 and decode > 0 and kv > 0):
            raise ValueError(f"profile: scale factors must be > 0, got prefill {prefill}, decode {decode}, kv {kv}")

        def times(table: Table1D, k: float) -> Table1D:
            return Table1D(table.xs, tuple(y * k for y in table.ys))
        return replace(self, prefill=times(self.prefill, prefill), kv_put=times(self.kv_put, kv),
                       kv_get=times(self.kv_get, kv),
                       decode_s=tuple(tuple(v * decode for v in row) for row in self.decode_s))

    def handoff_s(self, num_tokens: int) -> float:
        """The KV of `num_tokens` prompt tokens written by the prefill and read by the decode."""
        num_bytes = num_tokens * self.kv_bytes_per_token
        return self.kv_put(num_bytes) + self.kv_get(num_bytes)

    # ---- JSON ------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"source": self.source, "model": self.model,
                "prefill": {"tokens": list(self.prefill.xs), "seconds": list(self.prefill.ys)},
                "decode": {"batch_sizes": list(self.decode_batch_sizes), "contexts": list(self.decode_contexts),
                           "seconds": [list(r) for r in self.decode_s]},
                "kv_put": {"bytes": list(self.kv_put.xs), "seconds": list(self.kv_put.ys)},
                "kv_get": {"bytes": list(self.kv_get.xs), "seconds": list(self.kv_get.ys)},
                "kv_bytes_per_token": self.kv_bytes_per_token, "scheduler": asdict(self.scheduler),
                "request_overhead_s": self.request_overhead_s, "step_overhead_s": self.step_overhead_s,
                "kv_cpu_share": self.kv_cpu_share, "handoff_overhead_s": self.handoff_overhead_s,
                "neighbour_prefill_factor": self.neighbour_prefill_factor,
                "neighbour_decode_factor": self.neighbour_decode_factor}


def profile_from_json(raw: dict, where: str = "profile") -> Profile:
    """A Profile from its JSON; a missing or bad field raises ValueError naming it."""
    def field(path: str):
        node = raw
        for key in path.split("."):
            if not isinstance(node, dict) or key not in node:
                raise ValueError(f"{where}: missing field '{path}'")
            node = node[key]
        return node

    def table(name: str, x: str) -> Table1D:
        xs, ys = field(f"{name}.{x}"), field(f"{name}.seconds")
        try:
            return Table1D(tuple(float(v) for v in xs), tuple(float(v) for v in ys))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: field '{name}': {e}") from None

    def integers(path: str) -> tuple[int, ...]:
        try:
            return tuple(int(v) for v in field(path))
        except (TypeError, ValueError):
            raise ValueError(f"{where}: field '{path}' must be a list of integers, got {field(path)!r}") from None

    def integer(path: str) -> int:
        try:
            return int(field(path))
        except (TypeError, ValueError):
            raise ValueError(f"{where}: field '{path}' must be an integer, got {field(path)!r}") from None

    def number(name: str, default: float) -> float:
        try:
            return float(raw.get(name, default))
        except (TypeError, ValueError):
            raise ValueError(f"{where}: field '{name}' must be a number, got {raw.get(name)!r}") from None

    source = field("source")
    if not isinstance(source, str) or not source.startswith(("measured on ", "hand-written from published numbers")):
        raise ValueError(f"{where}: field 'source' must start with 'measured on ' or "
                         f"'hand-written from published numbers', got {source!r}")
    try:
        scheduler = SchedulerLimits(**raw.get("scheduler", {}))
    except TypeError as e:
        raise ValueError(f"{where}: field 'scheduler': {e}") from None
    return Profile(source=source, model=str(raw.get("model", "")), prefill=table("prefill", "tokens"),
                   decode_batch_sizes=integers("decode.batch_sizes"),
                   decode_contexts=integers("decode.contexts"),
                   decode_s=tuple(tuple(float(v) for v in row) for row in field("decode.seconds")),
                   kv_put=table("kv_put", "bytes"), kv_get=table("kv_get", "bytes"),
                   kv_bytes_per_token=integer("kv_bytes_per_token"), scheduler=scheduler,
                   request_overhead_s=number("request_overhead_s", 0.0),
                   step_overhead_s=number("step_overhead_s", 0.0), kv_cpu_share=number("kv_cpu_share", 0.0),
                   handoff_overhead_s=number("handoff_overhead_s", 0.0),
                   neighbour_prefill_factor=number("neighbour_prefill_factor", 1.0),
                   neighbour_decode_factor=number("neighbour_decode_factor", 1.0))


def load_profile(path: str) -> Profile:
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--profile: cannot read {path} ({e})") from None
    return profile_from_json(raw, where=path)


def save_profile(profile: Profile, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(profile.to_json(), f, indent=1)
        f.write("\n")
