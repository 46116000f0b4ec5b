"""The router's file discovery (what `pdserve up --autoscale` rewrites): changes are
picked up on the next poll, a bad or half-written file never empties a pool."""
from __future__ import annotations

import os

from pdserve.services.router.state.file_discovery import FileDiscovery, write_pools
from pdserve.services.router.state.workers import WorkerRegistry


def test_the_registry_follows_the_file(tmp_path):
    path = str(tmp_path / "workers.json")
    write_pools(path, {"prefill": ["127.0.0.1:1"], "decode": ["127.0.0.1:2"]})
    discovery = FileDiscovery(path)
    assert discovery.start()
    registry = WorkerRegistry(discovery)
    try:
        assert [v.address for v in registry.views("prefill")] == ["127.0.0.1:1"]
        write_pools(path, {"prefill": ["127.0.0.1:1", "127.0.0.1:3"], "decode": ["127.0.0.1:2"]})
        registry.sync()
        assert [v.address for v in registry.views("prefill")] == ["127.0.0.1:1", "127.0.0.1:3"]
        write_pools(path, {"prefill": ["127.0.0.1:3"], "decode": ["127.0.0.1:2"]})
        registry.sync()
        assert [v.address for v in registry.views("prefill")] == ["127.0.0.1:3"]
    finally:
        registry.close()


def test_a_bad_or_missing_file_keeps_the_last_list(tmp_path):
    path = str(tmp_path / "workers.json")
    write_pools(path, {"prefill": [], "decode": ["127.0.0.1:2"]})
    discovery = FileDiscovery(path)
    assert discovery.addresses("decode") == ("127.0.0.1:2",)
    with open(path, "w") as f:
        f.write('{"decode": ["127.0.0.1:2", ')  # what a non-atomic writer could leave
    assert discovery.addresses("decode") == ("127.0.0.1:2",)
    with open(path, "w") as f:
        f.write('{"decode": [7]}')
    assert discovery.addresses("decode") == ("127.0.0.1:2",)
    os.remove(path)
    assert discovery.addresses("decode") == ("127.0.0.1:2",)
    write_pools(path, {"decode": ["127.0.0.1:9"]})
    assert discovery.addresses("decode") == ("127.0.0.1:9",)
    assert not FileDiscovery(str(tmp_path / "none.json")).start()
