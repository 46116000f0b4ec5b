"""The KV transfer part of a profile: put_blocks and get_blocks of the model's KV shape
through a real in-process kvstore, as the prefill and decode workers move KV."""
from __future__ import annotations

import math
import os
import statistics
import time

from pdserve.sim.profile import Table1D


def kv_tables(block_shape, dtype, kv_blocks, repeats: int) -> tuple[Table1D, Table1D]:
    """put_blocks and get_blocks times by bytes, through a real in-process kvstore."""
    import torch
    from pdserve.engine.dtypes import dtype_name
    from pdserve.engine.kv_transfer import KVLayout, KVPayload
    from pdserve.services.kvstore.client import KVStoreClient
    from pdserve.services.kvstore.server import KVStoreConfig, serve
    from pdserve.services.worker.kv_wire import payload_from_batches, payload_to_put
    largest = max(kv_blocks) * math.prod(block_shape) * torch.empty((), dtype=dtype).element_size()
    store = serve(KVStoreConfig(port=0, capacity_bytes=4 * largest * (repeats + 2), metrics_port=None))
    client = KVStoreClient(store.address)
    layout = KVLayout.of("profile", dtype_name(dtype), tuple(block_shape))
    xs, puts, gets = [], [], []
    try:
        for n in kv_blocks:
            put_t, get_t = [], []
            for r in range(repeats + 1):
                payload = KVPayload(n * block_shape[2], torch.randn((n, *block_shape)).to(dtype),
                                    [os.urandom(32) for _ in range(n)])
                t = time.perf_counter()
                headers, data = payload_to_put(payload, layout, tail_key="")
                client.put_blocks(headers, data)
                t1 = time.perf_counter()
                got = payload_from_batches(client.get_blocks(payload.block_hashes), payload.block_hashes, layout)
                t2 = time.perf_counter()
                assert got.payload is not None and got.payload.num_blocks == n
                if r:  # the first of each size warms the connection up
                    put_t.append(t1 - t)
                    get_t.append(t2 - t1)
            xs.append(float(n * math.prod(block_shape) * payload.blocks.element_size()))
            puts.append(statistics.median(put_t))
            gets.append(statistics.median(get_t))
    finally:
        client.close()
        store.stop()
    return Table1D(tuple(xs), tuple(puts)), Table1D(tuple(xs), tuple(gets))
