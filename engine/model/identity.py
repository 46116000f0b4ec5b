"""A checkpoint's identity: a digest of the files that decide its outputs, never its path.

It names the model in every KV block hash and in the KV wire header, so two folders with
the same name but other weights (or new weights written over old ones while a kvstore keeps
the old blocks) never share a block, and the same files at two paths share all of them.

Hashing reads every weight byte once (sha256 runs at about 1-2 GB/s a core; the files are
hashed on threads, hashlib lets go of the GIL); a process keeps the result while the files'
sizes and modification times stay as they were.
"""
from __future__ import annotations

import hashlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from pdserve.engine.model.source import ModelSource

# what decides a Hugging Face folder's outputs: config and generation config, tokenizer
# files and chat template, weights; a README or an image beside them does not
_HF_SUFFIXES = (".json", ".safetensors", ".bin", ".model", ".txt", ".jinja", ".tiktoken")
_CHUNK = 8 << 20
_MAX_THREADS = 8

_cache: dict[tuple, str] = {}
_cache_lock = threading.Lock()


def checkpoint_files(source: ModelSource) -> list[str]:
    if source.kind == "gguf":
        return [source.path]
    names = sorted(n for n in os.listdir(source.path)
                   if n.endswith(_HF_SUFFIXES) and not n.startswith(".")
                   and os.path.isfile(os.path.join(source.path, n)))
    return [os.path.join(source.path, n) for n in names]


def checkpoint_identity(source: ModelSource) -> str:
    """The digest ("sha256:" and 32 hex digits) over each file's name (relative), size and bytes."""
    files = checkpoint_files(source)
    key = tuple((f, (st := os.stat(f)).st_size, st.st_mtime_ns) for f in files)
    with _cache_lock:
        if key in _cache:
            return _cache[key]
    with ThreadPoolExecutor(max_workers=max(1, min(_MAX_THREADS, len(files)))) as pool:
        digests = list(pool.map(_file_digest, files))
    total = hashlib.sha256()
    for path, digest in zip(files, digests):
        total.update(f"{os.path.basename(path)}\0{os.path.getsize(path)}\0".encode())
        total.update(digest)
    identity = "sha256:" + total.hexdigest()[:32]
    with _cache_lock:
        _cache[key] = identity
    return identity


def _file_digest(path: str) -> bytes:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.digest()
