"""Ports picked for processes started later: two picks of one process never overlap,
even when the random draw lands on the same ports (CI saw a worker of `pdserve up` fail
to bind a port also handed to the router)."""
from __future__ import annotations

import random
import socket

from pdserve.cli.bench.local_platform import free_port_range


class _Repeating(random.Random):
    """A draw that offers the same base first on every pick, then others."""

    def __init__(self, first: int):
        super().__init__(7)
        self.first, self.calls = first, 0

    def randrange(self, *args):
        self.calls += 1
        return self.first if self.calls % 2 == 1 else super().randrange(*args)


def _bindable_base(n: int) -> int:
    for base in range(24000, 30000, 17):
        socks = [socket.socket() for _ in range(n)]
        try:
            for i, s in enumerate(socks):
                s.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise AssertionError("no free ports to test with")


def test_two_picks_never_share_a_port_even_when_the_draw_repeats():
    base = _bindable_base(6)
    first = free_port_range(4, _Repeating(base))
    second = free_port_range(4, _Repeating(base))
    assert first == base
    assert second != first
    assert not set(range(first, first + 4)) & set(range(second, second + 4))


def test_a_port_bound_by_someone_else_is_not_handed_out():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        picked = free_port_range(1, _Repeating(port))
    assert picked != port
