"""The router's decisions in the simulator, made by the router's own code in
services/router/decide/: the path policy (paths.py path_policy), each pool's placement
policy (placement.py placement_policies) and the slot choice with its saturation rule
(slots.py choose_slot), over WorkerView snapshots as the router's registry keeps them:
each worker's load as last polled (every poll_interval_s) plus this router's own
in-flight counters, updated at once on reserve and release.

Not modelled: the KV index (NoPrefixes: placement sees no worker's prefix, so "kv"
placement decides by load alone), gRPC failures and retries, migrations.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from pdserve.services.router.decide.config import RoutingConfig
from pdserve.services.router.decide.paths import PathChoice, PoolsNow, path_policy
from pdserve.services.router.decide.placement import placement_policies
from pdserve.services.router.decide.saturation import SaturationPolicy
from pdserve.services.router.decide.slots import choose_slot
from pdserve.services.router.decide.views import DECODE, PREFILL, NoPrefixes, WorkerView
from pdserve.sim.trace import TRACE_BLOCK_SIZE

class PromptTokens(Sequence):
    """A prompt's token ids, made up on demand from its trace hash ids (the same ids give
    the same tokens, so prefix affinity sees shared prefixes) without building the list."""

    def __init__(self, num_tokens: int, hash_ids: tuple[int, ...], salt: int):
        self.num_tokens, self.hash_ids, self.salt = num_tokens, hash_ids, salt

    def __len__(self) -> int:
        return self.num_tokens

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.num_tokens))]
        if not -self.num_tokens <= i < self.num_tokens:
            raise IndexError(i)
        i %= self.num_tokens
        block = i // TRACE_BLOCK_SIZE
        owner = self.hash_ids[block] if block < len(self.hash_ids) else -1 - self.salt
        return 100 + (owner * 7919 + i * 104729) % 30000


class SimRouter:
    def __init__(self, cfg: RoutingConfig, colocated: bool):
        self.cfg = cfg
        self.paths = path_policy(cfg, colocated)
        self.reasons: Counter = Counter()
        self.policies = placement_policies(cfg, NoPrefixes(), colocated,
                                           count=lambda pool, reason: self.reasons.update([(pool, reason)]))
        self.saturation = SaturationPolicy(cfg.saturation)
        self.views: dict[str, dict[str, WorkerView]] = {PREFILL: {}, DECODE: {}}
        self.path_counts: Counter = Counter()

    def set_workers(self, pool: str, addresses: Sequence[str]) -> None:
        """Discovery: keep known workers' views, add new ones (down until polled), drop the rest."""
        old = self.views[pool]
        self.views[pool] = {a: old.get(a, WorkerView(a)) for a in addresses}

    def report(self, pool: str, address: str, load: dict) -> None:
        """A poll's answer (the worker's GetLoad), keeping this router's own counters."""
        v = self.views[pool].get(address)
        if v is not None:
            self.views[pool][address] = WorkerView(address, True, **load, in_flight=v.in_flight,
                                                   in_flight_tokens=v.in_flight_tokens)

    def choose_path(self, num_prompt_tokens: int, slo_class: str) -> PathChoice:
        pools = PoolsNow(self._up(PREFILL), self._up(DECODE), True)
        choice = self.paths.choose(num_prompt_tokens, slo_class, pools)
        self.path_counts[(choice.path, choice.reason)] += 1
        return choice

    def place(self, pool: str, prompt: Sequence[int], num_prefill_tokens: int) -> tuple[str, int] | None:
        """(address, tokens reserved) of the worker the pool's policy chooses among the
        unsaturated ones, reserved as the live pool does; None: all saturated (it waits)."""
        chosen = choose_slot(self._up(pool), self.saturation, self.policies[pool], prompt, num_prefill_tokens)
        if chosen is None:
            return None
        self._add(pool, chosen.address, 1, chosen.num_reserved_tokens)
        return chosen.address, chosen.num_reserved_tokens

    def release(self, pool: str, address: str, tokens: int) -> None:
        self._add(pool, address, -1, -tokens)

    def _up(self, pool: str) -> list[WorkerView]:
        return [w for w in self.views[pool].values() if w.up]

    def _add(self, pool: str, address: str, requests: int, tokens: int) -> None:
        v = self.views[pool].get(address)
        if v is not None:
            self.views[pool][address] = v.reserved(requests, tokens)
