"""The one thing a step carries from structured outputs to the runner: which tokens each
guided row may sample. Its own module so the scheduler's output can name it without
importing the grammar machinery (or torch)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class GrammarBitmask:
    """For the runner: bitmask row rows[req_id][j] constrains the request's j-th scored row
    (j > 0: after its j-th draft token)."""
    bitmask: torch.Tensor
    rows: dict[str, list[int]] = field(default_factory=dict)
