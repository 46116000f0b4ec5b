"""Where the chart's values.yaml lies, in a checkout and in an installed package alike.

`chart_values.yaml` beside this module is a link to deploy/helm/pdserve/values.yaml in the
repository; the wheel carries the file itself (pyproject.toml's package-data). The HPA
defaults of `pdserve up --autoscale` and the simulator's studies are read from it, so the
chart stays the one definition of targets, windows and policies.
"""
from __future__ import annotations

from pathlib import Path

CHART_VALUES = Path(__file__).resolve().parent / "chart_values.yaml"
