"""Where the workers are. Locally a static list; in a cluster (later) Kubernetes
EndpointSlices. The registry asks on every poll, so a discovery that changes its answer
adds and removes workers without a restart."""
from __future__ import annotations

from abc import ABC, abstractmethod

PREFILL = "prefill"
DECODE = "decode"
POOLS = (PREFILL, DECODE)


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


def parse_addresses(values: list[str] | None) -> tuple[str, ...]:
    """Repeatable and/or comma-separated host:port flags into one tuple (order kept, no repeats)."""
    found: list[str] = []
    for value in values or []:
        for address in value.split(","):
            address = address.strip()
            if not address:
                continue
            host, sep, port = address.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"worker address {address!r}: expected host:port")
            if address not in found:
                found.append(address)
    return tuple(found)
