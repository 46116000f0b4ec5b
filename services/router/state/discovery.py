"""Where the workers are: locally a static list (StaticDiscovery, from the --prefill and
--decode flags); in a cluster the ready endpoints of Kubernetes EndpointSlices
(k8s_discovery.py). The registry asks on every poll, so a discovery that changes its
answer adds and removes workers without a restart."""
from __future__ import annotations

from abc import ABC, abstractmethod

from pdserve.services.common.address import parse_addresses  # noqa: F401  (the flags' parser, re-exported)
from pdserve.services.router.decide.views import DECODE, POOLS, PREFILL  # noqa: F401  (the pools discovery names)


class Discovery(ABC):
    """The addresses (host:port) of each pool's workers, right now."""

    @abstractmethod
    def addresses(self, pool: str) -> tuple[str, ...]:
        ...


class StaticDiscovery(Discovery):
    def __init__(self, prefill: tuple[str, ...], decode: tuple[str, ...]):
        self._pools = {PREFILL: tuple(prefill), DECODE: tuple(decode)}

    def addresses(self, pool: str) -> tuple[str, ...]:
        return self._pools[pool]

