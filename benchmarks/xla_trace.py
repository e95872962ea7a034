"""The XLA kernels a call runs, from a `jax.profiler` trace: shared by the measuring scripts'
`--kernels` (benchmarks/throughput.py) and `--profile` (benchmarks/training.py).

On CPU each kernel a compiled program runs (a fusion, a copy, a scatter, a library call, and the
loops and branches that run others) is one trace event named after its instruction and carrying
it as `hlo_op`. Traced times include the profiler's own cost per event, a fraction of a
microsecond, so they rank kernels rather than time a program.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import re
import tempfile
from collections.abc import Callable
from typing import Any

import jax


def traced(fn: Callable[[], Any]) -> tuple[Any, list[dict]]:
    """`fn()`, run to completion under `jax.profiler`, and its trace's kernel events (`name`,
    `dur` in microseconds, ...)."""
    with tempfile.TemporaryDirectory() as folder:
        jax.profiler.start_trace(folder, create_perfetto_trace=True)
        out = jax.block_until_ready(fn())
        jax.profiler.stop_trace()
        (path,) = glob.glob(f"{folder}/**/perfetto_trace.json.gz", recursive=True)
        with gzip.open(path) as f:
            trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return out, [e for e in events if e.get("ph") == "X" and "hlo_op" in e.get("args", {})]


def kind(name: str) -> str:
    """An instruction's kind: its name without the numbering XLA adds (`add_tanh_fusion.12`)."""
    return re.sub(r"[.\d]+$", "", name)


def leaves(events: list[dict]) -> list[dict]:
    """The events that run no other kernel: loops, branches and calls (an event within whose span
    the next event of its thread starts) are left out, their time being their kernels'."""
    threads: dict[Any, list[dict]] = collections.defaultdict(list)
    for e in events:
        threads[e["tid"]].append(e)
    out = []
    for run in threads.values():
        run.sort(key=lambda e: float(e["ts"]))
        for e, after in zip(run, [*run[1:], None], strict=True):
            if after is None or float(after["ts"]) >= float(e["ts"]) + float(e.get("dur", 0.0)):
                out.append(e)
    return out


def time_by_kind(events: list[dict]) -> list[tuple[str, float, int]]:
    """(kind, traced microseconds, runs) of the kernels that run no other (`leaves`), most time
    first."""
    spent: collections.Counter = collections.Counter()
    runs: collections.Counter = collections.Counter()
    for e in leaves(events):
        k = kind(e["name"])
        spent[k] += float(e.get("dur", 0.0))
        runs[k] += 1
    return [(k, us, runs[k]) for k, us in spent.most_common()]
