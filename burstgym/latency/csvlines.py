"""The calibration tools' CSV files read line by line, so that every refusal names the file and
the line: a serving measurement CSV (`burstgym.latency.serving`) and a gateway access log
(`burstgym.latency.requestlog`)."""

from __future__ import annotations

import csv
from collections.abc import Iterator, Sequence
from pathlib import Path


def csv_rows(path: str | Path, required: Sequence[str]) -> Iterator[tuple[str, dict[str, str]]]:
    """`(where, row)` for each data row of the CSV file `path`: `where` is ``"<path>: line <n>"``
    for the caller's own refusals, `row` the header's lower-cased column names mapped to the row's
    stripped cells. Blank lines and lines starting with ``#`` are skipped. Refused with a
    `ValueError` naming the file (and the line): no such file, not text, a header without one of
    `required`, a row with more or fewer fields than the header, no header line at all."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a text file") from None
    header: list[str] | None = None
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        cells = [c.strip() for c in next(csv.reader([line]))]
        where = f"{path}: line {lineno}"
        if header is None:
            header = [c.lower() for c in cells]
            missing = [c for c in required if c not in header]
            if missing:
                raise ValueError(
                    f"{where}: missing column {missing[0]!r} (needs {', '.join(required)}; "
                    f"found: {', '.join(cells)})"
                )
            continue
        if len(cells) != len(header):
            raise ValueError(f"{where}: {len(cells)} fields, the header has {len(header)}")
        yield where, dict(zip(header, cells, strict=True))
    if header is None:
        raise ValueError(f"{path}: empty file (expected a header line)")
