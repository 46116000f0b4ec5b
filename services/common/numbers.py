"""Numbers on command lines: one argparse type for every bounded int or float flag, so each
refusal reads the same way, "argument --flag: must be <meaning> <bounds>, got '<text>'"
(argparse puts the flag's name in front).

    --lease-ttl-ms      number_arg(int, "a number of milliseconds", low=0, low_open=True)
    --max-step-ms       number_arg(float, "a number of milliseconds", low=0, note="0: no time bound")
    --port              port_arg(note="0: a free one")

Sizes with units (512MiB, 2GiB) are `sizes.parse_bytes`.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

MAX_PORT = 65535


@dataclass(frozen=True)
class NumberArg:
    """An argparse type: the text as `kind`, within [low, high] (a bound left None is open-ended;
    `*_open` excludes the bound itself). A float must be finite: nan and inf are refused."""
    kind: type = int
    meaning: str = "an integer"
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    note: str = ""   # after the bounds, in parentheses: what a special value means
    field: str = ""  # before the message, for a flag whose config field is named in its errors

    def __call__(self, text: str):
        value = self._convert(text)
        if value is None or not self.within(value):
            raise argparse.ArgumentTypeError(self.message(text))
        return value

    def _convert(self, text: str):
        try:
            value = self.kind(text)
        except (TypeError, ValueError):
            return None
        return value if self.kind is int or math.isfinite(value) else None

    def within(self, value) -> bool:
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    def bounds(self) -> str:
        """'>= 0', '> 0', '<= 1', or 'in (0, 1]' with both bounds."""
        if self.low is not None and self.high is not None:
            return (f"in {'(' if self.low_open else '['}{_shown(self.low)}, {_shown(self.high)}"
                    f"{')' if self.high_open else ']'}")
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {_shown(self.low)}"
        if self.high is not None:
            return f"{'<' if self.high_open else '<='} {_shown(self.high)}"
        return ""

    def message(self, text: str) -> str:
        what = " ".join(part for part in (self.meaning, self.bounds()) if part)
        note = f" ({self.note})" if self.note else ""
        field = f"{self.field}: " if self.field else ""
        return f"{field}must be {what}{note}, got {text!r}"


def _shown(bound: float) -> str:
    """1 and 1.0 both as '1', 0.5 as '0.5', 1000000 not as '1e+06'."""
    return str(int(bound)) if float(bound).is_integer() else repr(bound)


def number_arg(kind: type = int, meaning: str | None = None, *, low: float | None = None,
               high: float | None = None, low_open: bool = False, high_open: bool = False,
               note: str = "", field: str = "") -> NumberArg:
    """The argparse type for one number flag; `meaning` defaults to 'an integer' or 'a number'."""
    if kind not in (int, float):
        raise TypeError(f"number_arg: kind must be int or float, got {kind!r}")
    if meaning is None:
        meaning = "an integer" if kind is int else "a number"
    return NumberArg(kind, meaning, low, high, low_open, high_open, note, field)


def port_arg(note: str = "") -> NumberArg:
    """A TCP port, 0 to 65535 (0 usually: the system picks a free one)."""
    return number_arg(int, "a port number", low=0, high=MAX_PORT, note=note)
