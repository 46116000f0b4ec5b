"""engine/dtypes.py: the one dtype table, by name, and its torch conversions."""
from __future__ import annotations

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.dtypes import DTYPE_NAMES, DTYPE_SIZES, dtype_name, torch_dtype
from pdserve.engine.model.loader import parse_dtype


@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_names_sizes_and_torch_dtypes_agree(name):
    dtype = torch_dtype(name)
    assert torch.empty((), dtype=dtype).element_size() == DTYPE_SIZES[name]
    assert dtype_name(dtype) == name and parse_dtype(name) is dtype and parse_dtype(dtype) is dtype


def test_the_default_comes_first_and_unknown_dtypes_are_refused():
    assert DTYPE_NAMES[0] == EngineConfig().dtype
    with pytest.raises(ValueError, match="dtype"):
        torch_dtype("int4")
    with pytest.raises(ValueError, match="dtype"):
        dtype_name(torch.int8)
    with pytest.raises(ValueError, match="must be one of"):
        parse_dtype(torch.int8)
    assert parse_dtype("auto") is torch.float32
