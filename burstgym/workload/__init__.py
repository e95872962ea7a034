"""Workloads: the stream of requests an episode replays (arrival times, prompt and output lengths,
and the prompts' shared prefixes).

A `Workload` is composed of small parts, Jumanji-style, each in a file named for its job:
arrival processes (`arrivals.py`), length distributions (`lengths.py`), trace readers
(`traces.py`) and replay (`replay.py`), and generators of shared prefixes and multi-turn
conversations (`prefix.py`). Every part is a frozen, hashable dataclass, so a workload can be a
static argument of `jax.jit`; `sample(key, n)` is pure and vmaps over `key`. No part loops over
requests in Python. Sources and reasons for each part are in docs/workloads.md.
"""

from burstgym.workload.arrivals import DiurnalArrivals, GammaArrivals, MMPPArrivals, PoissonArrivals
from burstgym.workload.base import ArrivalProcess, LengthDistribution, Requests
from burstgym.workload.lengths import EmpiricalLengths, LogNormalLengths, ZipfLengths
from burstgym.workload.prefix import Conversations, SharedPrefixes
from burstgym.workload.replay import TraceReplay
from burstgym.workload.stream import Workload
from burstgym.workload.traces import Trace, load_trace

__all__ = [
    "ArrivalProcess",
    "Conversations",
    "DiurnalArrivals",
    "EmpiricalLengths",
    "GammaArrivals",
    "LengthDistribution",
    "LogNormalLengths",
    "MMPPArrivals",
    "PoissonArrivals",
    "Requests",
    "SharedPrefixes",
    "Trace",
    "TraceReplay",
    "Workload",
    "ZipfLengths",
    "load_trace",
]
