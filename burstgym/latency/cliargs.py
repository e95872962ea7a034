"""Command-line helpers shared by ``python -m burstgym.latency``, ``python -m burstgym.calibrate`` and
the measuring scripts of ``benchmarks/`` and ``scripts/``.

A bad flag is refused before any work starts, in one line that names the flag
(``prog: error: argument --max-tokens: must be an integer >= 64, got '-5'``), with exit status 2 as
argparse uses; the usage block is left to ``--help``.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NoReturn


class OneLineParser(argparse.ArgumentParser):
    """An `argparse.ArgumentParser` whose errors are one line: ``prog: error: message``."""

    def error(self, message: str) -> NoReturn:
        """Print ``prog: error: message`` on stderr and exit with status 2."""
        self.exit(2, f"{self.prog}: error: {message}\n")


@contextmanager
def refusals(parser: argparse.ArgumentParser) -> Iterator[None]:
    """Inside: what the library refuses (a `ValueError`, such as an unknown scenario or a bad
    setting, or a missing file) ends the command through ``parser.error``, not a traceback."""
    try:
        yield
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse ``type`` accepting integers >= ``low`` (argparse names the flag in the error)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def float_at_least(low: float) -> Callable[[str], float]:
    """An argparse ``type`` accepting finite numbers >= ``low``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number >= {low:g}, got {text!r}") from None
        if not math.isfinite(value) or value < low:
            raise argparse.ArgumentTypeError(f"must be a finite number >= {low:g}, got {text!r}")
        return value

    parse.__name__ = f"number >= {low:g}"
    return parse


def positive_float(text: str) -> float:
    """An argparse ``type`` accepting finite numbers > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value
