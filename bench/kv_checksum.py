"""What checking a KV block's bytes costs (issue 32): candidate checksums over SmolLM2-shaped
blocks (720 KiB each), each read in place from one payload tensor as the reader does, and
kv_integrity.checksum itself (header fields included). GB/s, the best of --repeats passes.

    .venv/bin/python -m bench.kv_checksum [--num-blocks 64] [--repeats 7]

Prints one JSON line per algorithm; one not installed says so. google-crc32c takes only
`bytes`, so its line includes the copy a reader would need first.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import time
import zlib

import torch
import xxhash

from bench.serve_kv_transfer import BLOCK_SHAPE
from pdserve.engine.kv_transfer import KVLayout
from pdserve.services.worker import kv_integrity
from pdserve.services.worker.kv_wire import block_header


def candidates() -> dict:
    found = {"zlib.crc32": zlib.crc32, "blake2b": lambda d: hashlib.blake2b(d).digest(),
             "kv_integrity.checksum (xxh3_64, with its header)": None}
    found["xxhash.xxh3_64"] = xxhash.xxh3_64_intdigest  # a dependency of the project (kv_integrity)
    found["xxhash.xxh64"] = xxhash.xxh64_intdigest
    # google-crc32c is no dependency, only a candidate compared when a reader installed it
    if importlib.util.find_spec("google_crc32c") is not None:
        import google_crc32c
        found["google_crc32c (after a copy to bytes)"] = lambda d: google_crc32c.value(bytes(d))
    else:
        found["google_crc32c (after a copy to bytes)"] = "not installed (optional: pip install google-crc32c)"
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-blocks", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    blocks = torch.randn((args.num_blocks, *BLOCK_SHAPE), generator=torch.Generator().manual_seed(0))
    data = memoryview(blocks.view(torch.uint8).numpy()).cast("B")
    nbytes = blocks[0].numel() * blocks.element_size()
    layout = KVLayout.of("bench", "float32", BLOCK_SHAPE)
    headers = [block_header(BLOCK_SHAPE, blocks.dtype, 16, bytes([i % 256]) * 32, layout=layout)
               for i in range(args.num_blocks)]
    for name, fn in candidates().items():
        if isinstance(fn, str):
            print(json.dumps({"checksum": name, "gb_s": None, "note": fn}))
            continue
        best = float("inf")
        for _ in range(args.repeats):
            start = time.perf_counter()
            for i in range(args.num_blocks):
                block = data[i * nbytes:(i + 1) * nbytes]
                if fn is None:
                    kv_integrity.checksum(headers[i], block)
                else:
                    fn(block)
            best = min(best, time.perf_counter() - start)
        print(json.dumps({"checksum": name, "gb_s": round(len(data) / best / 1e9, 2),
                          "ms_per_mib": round(best * 1e3 / (len(data) / (1 << 20)), 3)}))


if __name__ == "__main__":
    main()
