"""pdserve's version: the installed distribution's (pyproject.toml's `version`)."""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

DISTRIBUTION = "pdserve"
UNKNOWN = "0+unknown"  # a checkout run without being installed has no distribution metadata


def pdserve_version() -> str:
    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        return UNKNOWN
