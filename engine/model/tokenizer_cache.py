"""A GGUF model's tokenizer, converted once and kept on disk.

transformers builds a GGUF file's tokenizer by reading the whole vocabulary through the
`gguf` package twice (about 4 s for SmolLM2's 49,152 tokens) at every start of a router or
worker; the same tokenizer saved as tokenizer.json loads in about 0.25 s. The converted copy
lives under the user's cache folder, keyed by the GGUF file (path, size, modification time)
and the transformers and tokenizers versions, so any change to either converts again.

The folder is the only fence around a cached tokenizer (one planted there would change
every prompt's tokens), so it is created 0700 and not used when another user owns it or
others can write to it; nothing is cached when it cannot be made (a read-only home in a
container): the tokenizer is converted as before.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import stat
import tempfile

logger = logging.getLogger(__name__)

_FORMAT = "1"  # bump when what is saved changes


def cache_root() -> str:
    """PDSERVE_CACHE_DIR, else $XDG_CACHE_HOME/pdserve, else ~/.cache/pdserve."""
    explicit = os.environ.get("PDSERVE_CACHE_DIR")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pdserve")


def load_gguf_tokenizer(path: str):
    from transformers import AutoTokenizer
    folder = _usable_folder(os.path.join(cache_root(), "tokenizers"))
    entry = None if folder is None else os.path.join(folder, _key(path))
    if entry is not None and os.path.isdir(entry):
        try:
            return AutoTokenizer.from_pretrained(entry)
        except Exception as e:  # a damaged entry: convert again and replace it
            logger.warning("cached tokenizer %s unreadable (%s); converting %s again", entry, e, path)
            shutil.rmtree(entry, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    if entry is not None:
        _save(tokenizer, folder, entry)
    return tokenizer


def _key(path: str) -> str:
    import tokenizers
    import transformers
    real = os.path.realpath(path)
    st = os.stat(real)
    parts = (_FORMAT, real, str(st.st_size), str(st.st_mtime_ns), transformers.__version__, tokenizers.__version__)
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


def _usable_folder(folder: str) -> str | None:
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        st = os.stat(folder, follow_symlinks=False)
    except OSError as e:
        logger.debug("no tokenizer cache (%s): %s", folder, e)
        return None
    if not stat.S_ISDIR(st.st_mode):
        logger.warning("tokenizer cache %s is not a folder; not used", folder)
        return None
    if st.st_uid != os.geteuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        logger.warning("tokenizer cache %s is owned by another user or writable by others; not used", folder)
        return None
    return folder


def _save(tokenizer, folder: str, entry: str) -> None:
    """Saved beside the entry and renamed into place, so a reader never sees half of one
    (two processes converting at once: the first rename wins, the other copy is dropped)."""
    try:
        staging = tempfile.mkdtemp(dir=folder, prefix=".partial-")
    except OSError as e:
        logger.debug("tokenizer not cached: %s", e)
        return
    try:
        tokenizer.save_pretrained(staging)
        os.rename(staging, entry)
    except OSError as e:
        logger.debug("tokenizer not cached (%s): %s", entry, e)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
