"""The tail every bench script ends with: JSON lines as each measurement lands, one JSON
object as the result (the last stdout line, which the tests and docs/benchmarks.md read),
ratios between the conditions measured, and markdown tables for the docs."""
from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import TextIO


def emit_row(row: dict, file: TextIO | None = None) -> None:
    """One measurement, flushed at once: a later one may fail, and a reader follows along."""
    print(json.dumps(row), file=file or sys.stdout, flush=True)


def emit_result(result: dict) -> None:
    print(json.dumps(result))


def ratios(values: Mapping[str, float], pairs: Iterable[tuple[str, str]], key: str,
           digits: int | None = None) -> dict[str, float]:
    """{key.format(a=a, b=b): values[a] / values[b]} for each pair whose both sides were
    measured, in the pairs' order; rounded to `digits` when given."""
    out = {}
    for a, b in pairs:
        if a in values and b in values:
            ratio = values[a] / values[b]
            out[key.format(a=a, b=b)] = ratio if digits is None else round(ratio, digits)
    return out


def markdown_row(cells: Sequence) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def markdown_table(header: Sequence[str], rows: Iterable[Sequence], num_right_aligned: int = 0) -> str:
    """The header, its separator (the last `num_right_aligned` columns right-aligned), the rows."""
    align = ["---"] * (len(header) - num_right_aligned) + ["---:"] * num_right_aligned
    return "\n".join([markdown_row(header), "|" + "|".join(align) + "|", *(markdown_row(r) for r in rows)])
