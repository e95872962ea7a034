"""Command-line helpers shared by train.py and evaluate.py."""

from __future__ import annotations

import json
from typing import Any

PYTHON_CONSTANTS = {"True": True, "False": False, "None": None}
NON_FINITE = ("inf", "+inf", "-inf", "infinity", "+infinity", "-infinity", "nan")


def parse_settings(pairs: list[str]) -> dict[str, Any]:
    """`key=value` scenario overrides (`--set`). Values are read as JSON where they can be (numbers,
    `true`/`false`, `null`, lists, which become tuples as `Settings` expects), Python's `True`,
    `False` and `None` as those, `inf` and `nan` as floats (a setting that takes them, such as
    `sleep_timeout=inf`, or a refusal naming the field), anything else as a string."""
    out: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise ValueError(f"--set expects key=value, got {pair!r}")
        key, value = pair.split("=", 1)
        if value in PYTHON_CONSTANTS:
            out[key] = PYTHON_CONSTANTS[value]
            continue
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = float(value) if value.strip().lower() in NON_FINITE else value
        out[key] = tuple(parsed) if isinstance(parsed, list) else parsed
    return out
