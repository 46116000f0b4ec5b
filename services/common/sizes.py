"""Sizes on command lines: "2GiB", "512MiB", "1.5GB", "4096" (bytes)."""
from __future__ import annotations

import argparse
import re

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """"2GiB", "512MiB", "1.5GB", "4096" -> a positive number of bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 4096, 512MiB or 2GiB")
    value = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be above 0 bytes")
    return value
