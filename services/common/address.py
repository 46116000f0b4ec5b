"""host:port addresses, as every flag and config field writes them: one parser, so a bad
address is refused the same way (naming its field) wherever it comes in."""
from __future__ import annotations


def split_host_port(address: str, field: str) -> tuple[str, int]:
    """"host:port" or "[v6]:port" -> (host, port); ValueError naming `field` otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{field}: {address!r} is not host:port")
    return host.strip("[]"), int(port)


def parse_addresses(values: list[str] | None, field: str = "worker address") -> tuple[str, ...]:
    """Repeatable and/or comma-separated host:port flags into one tuple (order kept, no
    repeats); each address is checked and kept as written."""
    found: list[str] = []
    for value in values or []:
        for address in value.split(","):
            address = address.strip()
            if address and address not in found:
                split_host_port(address, field)
                found.append(address)
    return tuple(found)
