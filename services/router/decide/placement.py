"""Which policy chooses each pool's worker (RoutingConfig.placement), each decision counted
by reason in router_placement_total{pool, reason}.

    placement      prefill pool            decode pool: colocated   decode pool: after a prefill
    kv (default)   KVAwarePlacement        KVAwarePlacement         MostRoomDecode
    affinity       PrefixAffinityPrefill   PrefixAffinityPrefill    MostRoomDecode
    least_loaded   LeastQueuedPrefill      MostRoomDecode           MostRoomDecode

Colocated (no prefill pool) the decode workers prefill every prompt, so the prefix they
hold decides as it does for prefill workers. With a prefill pool the decode pool keeps
MostRoomDecode: most of its requests arrive with their KV already computed, and its
policy cannot tell those from direct-path prompts (Need.num_prefill_tokens would).
"""
from __future__ import annotations

from collections.abc import Callable

from pdserve.services.router.decide.config import RoutingConfig
from pdserve.services.router.decide.policy import (CountedPolicy, KVAwarePlacement, LeastQueuedPrefill, MostRoomDecode,
                                                   PrefixAffinityPrefill, WorkerPolicy, decode_load_tokens,
                                                   prefill_load_tokens)
from pdserve.services.router.decide.views import DECODE, PREFILL, PrefixIndex

def placement_policies(cfg: RoutingConfig, index: PrefixIndex, colocated: bool,
                       count: Callable[[str, str], None]) -> dict[str, WorkerPolicy]:
    """Each pool's policy; `count(pool, reason)` runs once per decision. `index`: the live
    KV index, or NoPrefixes where none is kept (the simulator)."""
    policies = {PREFILL: _policy(cfg, index, prefill_load_tokens, LeastQueuedPrefill()),
                DECODE: _policy(cfg, index, decode_load_tokens, MostRoomDecode()) if colocated else MostRoomDecode()}
    return {pool: CountedPolicy(p, lambda reason, pool=pool: count(pool, reason)) for pool, p in policies.items()}


def _policy(cfg: RoutingConfig, index: PrefixIndex, load, least_loaded: WorkerPolicy) -> WorkerPolicy:
    if cfg.placement == "kv":
        def match(addresses, token_ids):
            return index.match(addresses, token_ids, store=cfg.kvstore_address)
        return KVAwarePlacement(match, load, cfg.kv_store_weight, cfg.kv_host_weight)
    if cfg.placement == "affinity":
        return PrefixAffinityPrefill(cfg.affinity_max_extra_tokens, cfg.affinity_prefix_tokens)
    return least_loaded
