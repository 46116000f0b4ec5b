"""The settings the routing decisions read (RoutingConfig): SLO classes, when a worker
counts as saturated, how a path and a worker are chosen. They live here, beside the
decisions and free of gRPC, so the simulator builds them without the router's process;
RouterConfig (services/router/config.py) extends them with the process's own settings.

An SLO class names a latency contract (TTFT and ITL targets) and how the router treats
its requests while they wait: `priority` orders the admission queues (lower is served
first; it travels with the request and is the engine's priority on the workers too) and `max_queue_ms` bounds how
long a request may wait for a free worker before it is refused with a retry hint; a
class may also set its own direct-path threshold (`short_prompt_tokens`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

PATH_POLICIES = ("adaptive", "threshold", "colocated")
PLACEMENTS = ("kv", "affinity", "least_loaded")


@dataclass(frozen=True)
class SLOClass:
    ttft_ms: float          # target time to first token (exported; the HPA scales on it)
    itl_ms: float           # target inter-token latency
    priority: int = 0       # lower is served first
    max_queue_ms: float = 1000.0  # the longest a request waits in the router for a worker
    short_prompt_tokens: int | None = None  # this class's direct-path threshold (None: the router's)

    def __post_init__(self) -> None:
        # finite: each travels to the workers (in SLOTargets: ttft_ms as min_class_ttft_ms,
        # itl_ms as itl_target_ms), which refuse inf and NaN
        _require_finite_non_negative(self, ("ttft_ms", "itl_ms", "max_queue_ms"))


def _require_finite_non_negative(config, names: tuple[str, ...]) -> None:
    """ValueError naming the first of `names` whose value is not a finite number >= 0."""
    for name in names:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 <= value < math.inf):
            raise ValueError(f"{name}: must be a finite number >= 0, got {value!r}")


def default_slo_classes() -> dict[str, SLOClass]:
    return {"interactive": SLOClass(ttft_ms=1000.0, itl_ms=100.0, priority=0, max_queue_ms=1000.0),
            "batch": SLOClass(ttft_ms=30000.0, itl_ms=1000.0, priority=1, max_queue_ms=30000.0)}


DEFAULT_SLO_CLASS = "interactive"


@dataclass(frozen=True)
class SaturationConfig:
    """When a worker takes no more work from this router (see saturation.SaturationPolicy)."""
    max_waiting: int = 32                      # the worker's own queue (WorkerLoad.num_waiting)
    max_queued_prefill_tokens: int = 65536     # a prefill worker's backlog
    min_free_kv_blocks: int = 1                # a decode worker needs room for one more sequence
    max_in_flight_per_worker: int = 64         # requests this router has outstanding on one worker


@dataclass(frozen=True)
class PathConfig:
    """How the router chooses a request's path (see paths.py). The defaults are guesses
    used only until the workers have measured their own rates (GetLoad)."""
    policy: str = "adaptive"                    # "adaptive", "threshold" or "colocated"
    default_prefill_tokens_per_s: float = 1000.0
    default_decode_step_ms: float = 50.0
    kv_handoff_ms: float = 20.0                 # the hand-off's fixed cost before the first token
    # a prompt may prefill on a decode worker only if its whole prefill stalls the running
    # streams by at most this many (strictest) ITL targets, in chunks of at least:
    max_direct_stall_itls: float = 5.0
    min_direct_chunk_tokens: int = 8
    # a prompt rescued onto a decode worker (paths.py rule 4) whose streams have the TPOT room
    # for its whole prefill runs in steps of up to this long instead of the ITL room's chunks
    rescue_step_ms: float = 250.0

    def __post_init__(self) -> None:
        if self.policy not in PATH_POLICIES:
            raise ValueError(f"path policy: {self.policy!r} is not one of 'adaptive', 'threshold', 'colocated'")
        for name in ("default_prefill_tokens_per_s", "default_decode_step_ms"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        _require_finite_non_negative(self, ("kv_handoff_ms", "max_direct_stall_itls", "rescue_step_ms"))
        if self.min_direct_chunk_tokens < 1:
            raise ValueError(f"min_direct_chunk_tokens: must be >= 1, got {self.min_direct_chunk_tokens}")


@dataclass(frozen=True)
class RoutingConfig:
    """What the router's decisions (and the simulator's copy of them) read."""
    kvstore_address: str = ""       # where leases live when a KVHandle does not say
    paths: PathConfig = field(default_factory=PathConfig)
    short_prompt_tokens: int = 256  # the threshold policy: at most this many prompt tokens go direct
    slo_classes: dict[str, SLOClass] = field(default_factory=default_slo_classes)
    default_slo_class: str = DEFAULT_SLO_CLASS
    poll_interval_s: float = 0.2    # how old a worker's reported load may be
    saturation: SaturationConfig = field(default_factory=SaturationConfig)
    affinity_max_extra_tokens: int = 4096  # prefix affinity yields when it costs more queued tokens
    affinity_prefix_tokens: int = 16       # the leading block that names a prompt's prefix
    # how a pool's worker is chosen (placement.py): "kv" by the prefix each worker holds (its
    # KV events) minus its load; "affinity" by the first block's hash; "least_loaded"
    placement: str = "kv"
    # what a prompt token a worker need not compute is worth, against one in its device cache:
    kv_host_weight: float = 0.8            # in its host memory (a copy back; llm-d's CPU tier weighs 0.8)
    kv_store_weight: float = 0.5           # in the kvstore (a transfer): at most kv_host_weight

    def __post_init__(self) -> None:
        if self.default_slo_class not in self.slo_classes:
            raise ValueError(f"default_slo_class: {self.default_slo_class!r} is not among the SLO classes "
                             f"{sorted(self.slo_classes)}")
        if self.short_prompt_tokens < 0:
            raise ValueError(f"short_prompt_tokens: must be >= 0, got {self.short_prompt_tokens}")
        if self.poll_interval_s <= 0:
            raise ValueError(f"poll_interval_s: must be > 0, got {self.poll_interval_s}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement: {self.placement!r} is not one of {', '.join(PLACEMENTS)}")
        if not 0 <= self.kv_store_weight <= 1:
            raise ValueError(f"kv_store_weight: must be within [0, 1], got {self.kv_store_weight}")
        if not self.kv_store_weight <= self.kv_host_weight <= 1:  # device >= host >= store
            raise ValueError(f"kv_host_weight: must be within [kv_store_weight ({self.kv_store_weight}), 1], "
                             f"got {self.kv_host_weight}")
