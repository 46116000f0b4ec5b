"""The dtypes pdserve runs models and KV caches in, by name: the one table the engine, the
KV wire format, the kvstore's size checks and the command-line choices all read.

Names and sizes need no torch, so the kvstore and the CLI use them without loading it;
only the conversions to and from torch dtypes import torch, when called.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DTYPE_NAMES = ("float32", "bfloat16", "float16")            # the first is the default
DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2}   # bytes per element


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype called `name`; ValueError for a name not in DTYPE_NAMES."""
    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype: {name!r} is not one of {sorted(DTYPE_NAMES)}")
    import torch
    return getattr(torch, name)


def dtype_name(dtype: torch.dtype) -> str:
    """The inverse of torch_dtype; ValueError for a torch dtype pdserve does not run in."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype: {dtype} is not one of {sorted(DTYPE_NAMES)}")
    return name
