"""Which policy chooses each pool's worker (RouterConfig.placement), each decision counted
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

from services.router.config import RouterConfig
from services.router.discovery import DECODE, POOLS, PREFILL
from services.router.kv_index import KVIndex
from services.router.kv_subscriber import KVSubscribers
from services.router.policy import (CountedPolicy, KVAwarePlacement, LeastQueuedPrefill, MostRoomDecode,
                                    PrefixAffinityPrefill, WorkerPolicy, decode_load_tokens, prefill_load_tokens)
from services.router.workers import WorkerRegistry


def placement_policies(cfg: RouterConfig, index: KVIndex, colocated: bool,
                       count: Callable[[str, str], None]) -> dict[str, WorkerPolicy]:
    """Each pool's policy; `count(pool, reason)` runs once per decision."""
    policies = {PREFILL: _policy(cfg, index, prefill_load_tokens, LeastQueuedPrefill()),
                DECODE: _policy(cfg, index, decode_load_tokens, MostRoomDecode()) if colocated else MostRoomDecode()}
    return {pool: CountedPolicy(p, lambda reason, pool=pool: count(pool, reason)) for pool, p in policies.items()}


def _policy(cfg: RouterConfig, index: KVIndex, load, least_loaded: WorkerPolicy) -> WorkerPolicy:
    if cfg.placement == "kv":
        def match(addresses, token_ids):
            return index.match(addresses, token_ids, store=cfg.kvstore_address)
        return KVAwarePlacement(match, load, cfg.kv_store_weight)
    if cfg.placement == "affinity":
        return PrefixAffinityPrefill(cfg.affinity_max_extra_tokens, cfg.affinity_prefix_tokens)
    return least_loaded


class KVSources:
    """The sources the KV index follows: every worker the registry knows, and the kvstore;
    none unless placement is "kv" (nothing would read the index)."""

    def __init__(self, cfg: RouterConfig, registry: WorkerRegistry, index: KVIndex):
        self.enabled = cfg.placement == "kv"
        self.kvstore_address = cfg.kvstore_address
        self.registry = registry
        self.subscribers = KVSubscribers(index, cfg.internal)

    def sync(self) -> None:
        if self.enabled:
            workers = [v.address for pool in POOLS for v in self.registry.views(pool)]
            self.subscribers.sync([*workers, self.kvstore_address])

    def close(self) -> None:
        self.subscribers.close()
