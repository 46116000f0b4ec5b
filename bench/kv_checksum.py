"""What checking a KV block's bytes costs (issue 32): candidate checksums over SmolLM2-shaped
blocks (720 KiB each), each read in place from one payload tensor as the reader does, and
kv_integrity.checksum itself (header fields included), and the keyed candidates for issue
49's seal: keyed BLAKE3 (when installed), HMAC-SHA256, ChaCha20-Poly1305 and AES-256-GCM
(encrypt and authenticate), and kv_integrity.seal_encrypted / the check that opens it
(AES-256-GCM, a key per block). GB/s, the best of --repeats passes.

    .venv/bin/python -m bench.kv_checksum [--num-blocks 64] [--repeats 7]

Prints one JSON line per algorithm; one not installed says so. google-crc32c takes only
`bytes`, so its line includes the copy a reader would need first.
"""
from __future__ import annotations

import argparse
import hashlib
import hmac
import importlib.util
import json
import time
import zlib

import torch
import xxhash
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

from bench.serve_kv_transfer import BLOCK_SHAPE
from pdserve.engine.kv_transfer import KVLayout
from pdserve.services.worker import kv_integrity
from pdserve.services.worker.kv_seal import KVKeys
from pdserve.services.worker.kv_wire import block_header


def candidates() -> dict:
    found = {"zlib.crc32": zlib.crc32, "blake2b": lambda d: hashlib.blake2b(d).digest(),
             "kv_integrity.checksum (xxh3_64, with its header)": None}
    found["xxhash.xxh3_64"] = xxhash.xxh3_64_intdigest  # a dependency of the project (kv_integrity)
    found["xxhash.xxh64"] = xxhash.xxh64_intdigest
    key, nonce = bytes(range(32)), bytes(12)
    found["hmac-sha256 (keyed)"] = lambda d: hmac.digest(key, d, "sha256")
    found["chacha20-poly1305 (encrypt + tag)"] = lambda d: ChaCha20Poly1305(key).encrypt(nonce, d, b"")
    found["aes-256-gcm (encrypt + tag)"] = lambda d: AESGCM(key).encrypt(nonce, d, b"")
    found["kv_integrity.seal_encrypted (aes-256-gcm, key per block)"] = "seal"
    found["kv_integrity.refusal, sealed (decrypt + verify)"] = "open"
    if importlib.util.find_spec("blake3") is not None:
        import blake3
        found["blake3 (keyed)"] = lambda d: blake3.blake3(d, key=key).digest()
    else:
        found["blake3 (keyed)"] = "not installed (optional: pip install blake3)"
    # google-crc32c is no dependency, only a candidate compared when a reader installed it
    if importlib.util.find_spec("google_crc32c") is not None:
        import google_crc32c
        found["google_crc32c (after a copy to bytes)"] = lambda d: google_crc32c.value(bytes(d))
    else:
        found["google_crc32c (after a copy to bytes)"] = "not installed (optional: pip install google-crc32c)"
    return found


def opener(headers, layout: KVLayout, keys: KVKeys, out):
    """A reader's check of sealed block i: header, tag, and the decryption into `out`."""
    def open_block(i: int, data) -> None:
        refused = kv_integrity.refusal(headers[i], data, layout, headers[i].block_hash, keys=keys, out=out)
        assert refused is None, refused
    return open_block


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
    keys, out = KVKeys.from_token("bench"), memoryview(bytearray(nbytes))
    sealed = memoryview(bytearray(len(data)))  # every block sealed once: what the "open" candidate reads
    sealed_headers = [kv_integrity.seal_encrypted(block_header(BLOCK_SHAPE, blocks.dtype, 16, h.block_hash,
                                                               layout=layout),
                                                  data[i * nbytes:(i + 1) * nbytes], sealed[i * nbytes:(i + 1) * nbytes],
                                                  keys) for i, h in enumerate(headers)]
    for name, fn in candidates().items():
        source = sealed if fn == "open" else data
        if fn == "seal":
            fn = lambda i, d: kv_integrity.seal_encrypted(headers[i], d, out, keys)  # noqa: E731
        elif fn == "open":
            fn = opener(sealed_headers, layout, keys, out)
        elif fn is None:
            fn = lambda i, d: kv_integrity.checksum(headers[i], d)  # noqa: E731
        elif not isinstance(fn, str):
            fn = (lambda f: lambda i, d: f(d))(fn)
        if isinstance(fn, str):
            print(json.dumps({"checksum": name, "gb_s": None, "note": fn}))
            continue
        best = float("inf")
        for _ in range(args.repeats):
            start = time.perf_counter()
            for i in range(args.num_blocks):
                fn(i, source[i * nbytes:(i + 1) * nbytes])
            best = min(best, time.perf_counter() - start)
        print(json.dumps({"checksum": name, "gb_s": round(len(data) / best / 1e9, 2),
                          "ms_per_mib": round(best * 1e3 / (len(data) / (1 << 20)), 3)}))


if __name__ == "__main__":
    main()
