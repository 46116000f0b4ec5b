"""The command lines of Mooncake's programs (`mooncake_master`, `mooncake_client`), checked
the way gflags parses them: every `--name=value` must name a flag the installed binary
declares, and the value must read as that flag's type. The flags and their types come from
the binary itself (`--helpxml`), so a flag renamed or dropped by a Mooncake upgrade fails
the chart's tests instead of a pod's start.

(gflags itself cannot be asked without starting the program: with a help flag it skips
reporting unknown flags, and without one the program runs.)
"""
from __future__ import annotations

import functools
import re
import subprocess
import xml.etree.ElementTree as ET

import pytest

from pdserve.cli.mooncake_procs import mooncake_binary

MOONCAKE_PROGRAMS = ("mooncake_master", "mooncake_client")
_BOOLS = {"true", "false", "t", "f", "yes", "no", "y", "n", "1", "0"}
_INT_RANGES = {"int32": (-2**31, 2**31 - 1), "int64": (-2**63, 2**63 - 1),
               "uint32": (0, 2**32 - 1), "uint64": (0, 2**64 - 1)}


def binary(program: str) -> str:
    """The program's path in the installed mooncake package; fails the test without it
    (`make test` installs the wheel: a missing one is a broken setup, not a reason to skip)."""
    try:
        return mooncake_binary(program)
    except RuntimeError as e:
        pytest.fail(str(e))


@functools.cache
def flag_types(program: str) -> dict[str, str]:
    """name -> gflags type ("bool", "int32", "double", "string", ...) of every flag the
    program accepts, its own and those of the libraries it links (glog)."""
    done = subprocess.run([binary(program), "--helpxml"], capture_output=True, text=True, timeout=60)
    flags = {f.findtext("name"): f.findtext("type") for f in ET.fromstring(done.stdout).iter("flag")}
    assert len(flags) > 10, f"{program} --helpxml listed no flags: {done.stdout[:500]} {done.stderr[:500]}"
    return flags


def _reads_as(kind: str, value: str) -> bool:
    if kind == "bool":
        return value.lower() in _BOOLS
    if kind in _INT_RANGES:
        if not re.fullmatch(r"[+-]?(0[xX][0-9a-fA-F]+|[0-9]+)", value):
            return False
        low, high = _INT_RANGES[kind]
        return low <= int(value, 0 if value.lstrip("+-").lower().startswith("0x") else 10) <= high
    if kind == "double":
        try:
            float(value)
        except ValueError:
            return False
        return True
    return kind == "string"


def parse(program: str, args: list[str]) -> dict[str, str]:
    """{flag: value} of a command line as the installed `program` would take it; fails the
    test naming the first flag it would refuse."""
    types = flag_types(program)
    found = {}
    for arg in args:
        match = re.fullmatch(r"--?([A-Za-z0-9_]+)(?:=(.*))?", arg, re.S)
        assert match, f"{program}: {arg!r} is not a --flag=value"
        name, value = match.group(1), match.group(2)
        if value is None:  # --flag / --noflag: booleans only
            base = name[2:] if name.startswith("no") and name[2:] in types else name
            assert types.get(base) == "bool", f"{program}: {arg!r} without a value is only for a bool flag"
            found[base] = "false" if base != name else "true"
            continue
        assert name in types, f"{program} has no flag --{name} (its flags: {sorted(types)})"
        assert _reads_as(types[name], value), f"{program}: --{name}={value!r} is not a {types[name]}"
        found[name] = value
    return found
