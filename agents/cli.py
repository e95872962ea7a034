"""Command-line helpers shared by train.py and evaluate.py."""

from __future__ import annotations

import json
from typing import Any


def parse_settings(pairs: list[str]) -> dict[str, Any]:
    """`key=value` scenario overrides (`--set`); values parsed as JSON when they can be (numbers, lists)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise ValueError(f"--set expects key=value, got {pair!r}")
        key, value = pair.split("=", 1)
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out
