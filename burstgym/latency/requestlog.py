"""Request logs: what a benchmark client or a gateway recorded of each request a server handled.

A `ServingLog` holds, per request, the time it was sent (relative to the first), its prompt and output
tokens, whether it failed, and the measured time to the first token (TTFT) and end-to-end latency
(E2E); optionally the server's settings (from the inference-sim replay format's config block) and a
shared-prefix group. Readers, one per format (docs/latency.md, "Request logs"):

- ``inference-sim``: the BLIS/inference-sim replay JSON (a ``config`` block, a ``requests`` list) with
  its measured latencies in a separate ``<run>_ground_truth.json`` (``truth``);
- ``vllm``: ``vllm bench serve --save-result --save-detailed`` JSON (``start_times``, ``input_lens``,
  ``output_lens``, ``ttfts``, ``itls``, ``errors``);
- ``inference-perf``: inference-perf's ``per_request_lifecycle_metrics.json`` (``start_time``,
  ``end_time``, ``info.input_tokens``, ``info.output_tokens``, ``info.output_token_times``, ``error``);
- ``gateway-csv``: an access-log CSV with a header naming ``start_time``, ``prompt_tokens``,
  ``completion_tokens``, ``ttft_ms``, ``duration_ms`` and optionally ``status`` and ``prefix_group``.

Bad input is a ValueError naming the file, the line (CSV) or the request (JSON, by its position in
the file's list) and the field.
"""

from __future__ import annotations

import datetime as dt
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from burstgym.latency.csvlines import csv_rows

FORMATS = ("inference-sim", "vllm", "inference-perf", "gateway-csv")
CSV_COLUMNS = ("start_time", "prompt_tokens", "completion_tokens", "ttft_ms", "duration_ms")


@dataclass(frozen=True)
class ServerSettings:
    """The serving settings a log states (inference-sim's config block); None where it does not."""

    tp: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    kv_blocks: int | None = None
    block_size: int | None = None
    system_prompt_tokens: int | None = None  # tokens of the prompt prefix shared within a prefix group


@dataclass(frozen=True)
class ServingLog:
    """One log's requests, in the order they were sent; every array has one entry per request."""

    source: str  # the file (and truth file) read
    format: str  # one of FORMATS
    arrival_s: np.ndarray  # float64, seconds since the first request was sent
    prompt_tokens: np.ndarray  # int64, >= 1 (0: a failed request whose prompt the log does not count)
    output_tokens: np.ndarray  # int64, >= 0 (tokens the client counted)
    ok: np.ndarray  # bool, the request succeeded (failed ones carry no latency)
    ttft_s: np.ndarray  # float64, measured TTFT (NaN where unknown or failed)
    e2e_s: np.ndarray  # float64, measured end-to-end latency (NaN where unknown or failed)
    prefix_group: np.ndarray  # int64, shared-prefix group (-1: none)
    server: ServerSettings = ServerSettings()

    def __len__(self) -> int:
        return len(self.arrival_s)

    def subset(self, mask: np.ndarray) -> ServingLog:
        """The requests where ``mask`` holds (arrival times kept, not re-based)."""
        fields = ("arrival_s", "prompt_tokens", "output_tokens", "ok", "ttft_s", "e2e_s", "prefix_group")
        return replace(self, **{f: getattr(self, f)[mask] for f in fields})

    def with_output_tokens(self, tokens: int) -> ServingLog:
        """Every request as having generated ``tokens`` tokens (a server run with ``ignore_eos`` and
        ``max_tokens`` = ``tokens``, whose client counted fewer: see docs/latency.md)."""
        return replace(self, output_tokens=np.full(len(self), int(tokens), dtype=np.int64))


# --- field checks --------------------------------------------------------------------------------


def _int(value: Any, where: str, field: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{where}: field {field!r}: expected an integer >= {low}, got {value!r}")
    if value != int(value) or value < low or value > 2**31 - 1:
        raise ValueError(f"{where}: field {field!r}: expected an integer in [{low}, 2^31), got {value!r}")
    return int(value)


def _seconds(value: Any, where: str, field: str, low: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{where}: field {field!r}: expected a finite number of seconds, got {value!r}")
    if value < low:
        raise ValueError(f"{where}: field {field!r}: must be >= {low:g}, got {value!r}")
    return float(value)


def _bool(value: Any, where: str, field: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{where}: field {field!r}: expected true or false, got {value!r}")
    return value


def _read_json(path: Path) -> Any:
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    try:
        return json.loads(path.read_text())
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a text file") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: line {err.lineno}: malformed JSON ({err.msg})") from None


def _finish(
    source: str,
    fmt: str,
    sent: list[float],
    prompt: list[int],
    output: list[int],
    ok: list[bool],
    ttft: list[float],
    e2e: list[float],
    group: list[int] | None = None,
    server: ServerSettings = ServerSettings(),
) -> ServingLog:
    """Assemble a log: requests sorted by send time (stable), times re-based to the first."""
    if not sent:
        raise ValueError(f"{source}: no requests")
    order = np.argsort(np.asarray(sent, dtype=np.float64), kind="stable")
    arrival = np.asarray(sent, dtype=np.float64)[order]
    ok_a = np.asarray(ok, dtype=bool)[order]
    ttft_a = np.where(ok_a, np.asarray(ttft, dtype=np.float64)[order], np.nan)
    e2e_a = np.where(ok_a, np.asarray(e2e, dtype=np.float64)[order], np.nan)
    return ServingLog(
        source=source,
        format=fmt,
        arrival_s=arrival - arrival[0],
        prompt_tokens=np.asarray(prompt, dtype=np.int64)[order],
        output_tokens=np.asarray(output, dtype=np.int64)[order],
        ok=ok_a,
        ttft_s=ttft_a,
        e2e_s=e2e_a,
        prefix_group=np.asarray(group if group is not None else [-1] * len(sent), dtype=np.int64)[order],
        server=server,
    )


def _check_latencies(where: str, ttft: float, e2e: float) -> None:
    if e2e < ttft:
        raise ValueError(
            f"{where}: field 'e2e': end-to-end latency {e2e!r} s is shorter than TTFT {ttft!r} s"
        )


# --- inference-sim -------------------------------------------------------------------------------

_SIM_CONFIG = {
    "tensor_parallelism": "tp",
    "max_num_seqs": "max_num_seqs",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "kv_blocks_total_gpu": "kv_blocks",
    "block_size": "block_size",
    "system_prompt_len": "system_prompt_tokens",
}


def _indexed(records: list, source: Path) -> Iterator[tuple[str, int, dict]]:
    """Each record of an inference-sim list with where it is (for messages) and its `index` field,
    refusing a record that is not an object or repeats an index."""
    seen: set[int] = set()
    for n, rec in enumerate(records):
        where = f"{source}: request {n}"
        if not isinstance(rec, dict):
            raise ValueError(f"{where}: expected an object")
        index = _int(rec.get("index"), where, "index", 0)
        if index in seen:
            raise ValueError(f"{where}: field 'index': {index} appears twice")
        seen.add(index)
        yield where, index, rec


def read_inference_sim(path: str | Path, truth: str | Path | None) -> ServingLog:
    """The inference-sim replay format: ``{"config": {...}, "requests": [{"index", "arrival_time_us",
    "input_tokens", "output_tokens", "prefix_group", "has_error"}, ...]}`` plus the measured
    ``[{"index", "has_error", "ttft_s", "e2e_s"}, ...]`` of ``truth``."""
    path = Path(path)
    if truth is None:
        raise ValueError(f"{path}: the inference-sim format keeps its measured latencies apart: give --truth")
    data = _read_json(path)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object with 'config' and 'requests'")
    config = data.get("config", {})
    if not isinstance(config, dict):
        raise ValueError(f"{path}: field 'config': expected an object")
    settings: dict[str, int | None] = {}
    for key, name in _SIM_CONFIG.items():
        if key in config:
            low = 0 if key == "system_prompt_len" else 1
            settings[name] = _int(config[key], f"{path} [config]", key, low)
    requests = data.get("requests")
    if not isinstance(requests, list):
        raise ValueError(f"{path}: field 'requests': expected a list")
    truth = Path(truth)
    measured = _read_json(truth)
    if not isinstance(measured, list):
        raise ValueError(f"{truth}: expected a JSON list of per-request latencies")
    by_index: dict[int, tuple[bool, float, float]] = {}
    for where, index, rec in _indexed(measured, truth):
        failed = _bool(rec.get("has_error"), where, "has_error")
        if failed:
            by_index[index] = (False, math.nan, math.nan)
            continue
        ttft = _seconds(rec.get("ttft_s"), where, "ttft_s")
        e2e = _seconds(rec.get("e2e_s"), where, "e2e_s")
        _check_latencies(where, ttft, e2e)
        by_index[index] = (True, ttft, e2e)
    groups: dict[str, int] = {}
    cols: dict[str, list] = {k: [] for k in ("sent", "prompt", "output", "ok", "ttft", "e2e", "group")}
    seen = set()
    for where, index, rec in _indexed(requests, path):
        seen.add(index)
        if index not in by_index:
            raise ValueError(f"{where}: field 'index': {index} has no entry in {truth}")
        ok, ttft, e2e = by_index[index]
        if _bool(rec.get("has_error", False), where, "has_error") == ok:
            raise ValueError(f"{where}: field 'has_error' disagrees with {truth}")
        group = rec.get("prefix_group", "")
        if not isinstance(group, (str, int)) or isinstance(group, bool):
            raise ValueError(f"{where}: field 'prefix_group': expected a string, got {group!r}")
        cols["sent"].append(_int(rec.get("arrival_time_us"), where, "arrival_time_us", 0) * 1e-6)
        cols["prompt"].append(_int(rec.get("input_tokens"), where, "input_tokens", int(ok)))
        cols["output"].append(_int(rec.get("output_tokens"), where, "output_tokens", 0))
        cols["ok"].append(ok)
        cols["ttft"].append(ttft)
        cols["e2e"].append(e2e)
        cols["group"].append(groups.setdefault(str(group), len(groups)) if group != "" else -1)
    missing = sorted(set(by_index) - seen)
    if missing:
        raise ValueError(f"{truth}: request index {missing[0]} is not in {path}")
    return _finish(
        f"{path} + {truth}",
        "inference-sim",
        cols["sent"],
        cols["prompt"],
        cols["output"],
        cols["ok"],
        cols["ttft"],
        cols["e2e"],
        cols["group"],
        ServerSettings(**settings),
    )


# --- vllm bench serve ----------------------------------------------------------------------------

_VLLM_LISTS = ("start_times", "input_lens", "output_lens", "ttfts", "itls", "errors")


def read_vllm_bench(path: str | Path) -> ServingLog:
    """``vllm bench serve --save-result --save-detailed`` JSON: per-request lists ``start_times``
    (client clock, seconds), ``input_lens``, ``output_lens``, ``ttfts`` (s), ``itls`` (the gaps between
    streamed chunks, s) and ``errors`` ("" on success). E2E is TTFT plus the gaps."""
    path = Path(path)
    data = _read_json(path)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object (vllm bench serve --save-result)")
    for key in _VLLM_LISTS:
        if key not in data:
            hint = " (save with --save-detailed)" if key != "start_times" else " (a vLLM that records it)"
            raise ValueError(f"{path}: field {key!r} is missing{hint}")
        if not isinstance(data[key], list):
            raise ValueError(f"{path}: field {key!r}: expected a list")
    n = len(data["start_times"])
    for key in _VLLM_LISTS:
        if len(data[key]) != n:
            raise ValueError(f"{path}: field {key!r} has {len(data[key])} entries, 'start_times' has {n}")
    cols: dict[str, list] = {k: [] for k in ("sent", "prompt", "output", "ok", "ttft", "e2e")}
    for i in range(n):
        where = f"{path}: request {i}"
        error = data["errors"][i]
        if not isinstance(error, str):
            raise ValueError(f"{where}: field 'errors': expected a string, got {error!r}")
        ok = error == ""
        cols["sent"].append(_seconds(data["start_times"][i], where, "start_times", -math.inf))
        cols["prompt"].append(_int(data["input_lens"][i], where, "input_lens", int(ok)))
        cols["output"].append(_int(data["output_lens"][i], where, "output_lens", 0))
        cols["ok"].append(ok)
        if not ok:
            cols["ttft"].append(math.nan)
            cols["e2e"].append(math.nan)
            continue
        ttft = _seconds(data["ttfts"][i], where, "ttfts")
        gaps = data["itls"][i]
        if not isinstance(gaps, list):
            raise ValueError(f"{where}: field 'itls': expected a list of seconds")
        total = sum(_seconds(g, where, "itls") for g in gaps)
        cols["ttft"].append(ttft)
        cols["e2e"].append(ttft + total)
    return _finish(
        str(path), "vllm", cols["sent"], cols["prompt"], cols["output"], cols["ok"], cols["ttft"], cols["e2e"]
    )


# --- inference-perf ------------------------------------------------------------------------------


def read_inference_perf(path: str | Path) -> ServingLog:
    """inference-perf's ``per_request_lifecycle_metrics.json``: a list of ``{"start_time", "end_time",
    "info": {"input_tokens", "output_tokens", "output_token_times"}, "error"}`` (client monotonic
    clock, seconds). TTFT is the first output token time minus the start, E2E the end minus the start."""
    path = Path(path)
    data = _read_json(path)
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of per-request lifecycle records")
    cols: dict[str, list] = {k: [] for k in ("sent", "prompt", "output", "ok", "ttft", "e2e")}
    for i, rec in enumerate(data):
        where = f"{path}: request {i}"
        if not isinstance(rec, dict):
            raise ValueError(f"{where}: expected an object")
        info = rec.get("info")
        if not isinstance(info, dict):
            raise ValueError(f"{where}: field 'info': expected an object")
        start = _seconds(rec.get("start_time"), where, "start_time", -math.inf)
        ok = rec.get("error") is None
        cols["sent"].append(start)
        cols["prompt"].append(_int(info.get("input_tokens"), where, "info.input_tokens", int(ok)))
        cols["output"].append(_int(info.get("output_tokens"), where, "info.output_tokens", 0))
        cols["ok"].append(ok)
        if not ok:
            cols["ttft"].append(math.nan)
            cols["e2e"].append(math.nan)
            continue
        end = _seconds(rec.get("end_time"), where, "end_time", -math.inf)
        times = info.get("output_token_times")
        if not isinstance(times, list) or not times:
            raise ValueError(f"{where}: field 'info.output_token_times': expected a non-empty list")
        first = _seconds(times[0], where, "info.output_token_times", -math.inf)
        if first < start:
            raise ValueError(f"{where}: field 'info.output_token_times': first token before 'start_time'")
        _check_latencies(where, first - start, end - start)
        cols["ttft"].append(first - start)
        cols["e2e"].append(end - start)
    return _finish(
        str(path),
        "inference-perf",
        cols["sent"],
        cols["prompt"],
        cols["output"],
        cols["ok"],
        cols["ttft"],
        cols["e2e"],
    )


# --- gateway access-log CSV ----------------------------------------------------------------------


def _start_time(text: str, where: str) -> float:
    """Seconds (any origin) or an ISO 8601 time (UTC unless it names its zone)."""
    try:
        seconds = float(text)
    except ValueError:
        try:
            stamp = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
        except ValueError:
            raise ValueError(
                f"{where}: field 'start_time': expected seconds or an ISO 8601 time, got {text!r}"
            ) from None
        if stamp.tzinfo is None:
            stamp = stamp.replace(tzinfo=dt.timezone.utc)
        return stamp.timestamp()
    return _seconds(seconds, where, "start_time", -math.inf)


def read_gateway_csv(path: str | Path) -> ServingLog:
    """A gateway access log as CSV (columns in docs/latency.md): ``start_time`` (seconds or ISO 8601),
    ``prompt_tokens``, ``completion_tokens``, ``ttft_ms`` (time to the first response byte of the
    stream), ``duration_ms`` (to the last byte), optional ``status`` (HTTP code; >= 400 is a failure)
    and ``prefix_group``. Blank lines and lines starting with ``#`` are skipped."""
    cols: dict[str, list] = {k: [] for k in ("sent", "prompt", "output", "ok", "ttft", "e2e", "group")}
    groups: dict[str, int] = {}
    for where, row in csv_rows(path, CSV_COLUMNS):

        def number(col: str, where: str = where, row: dict[str, str] = row) -> float:
            try:
                return float(row[col])
            except ValueError:
                raise ValueError(f"{where}: field {col!r}: not a number: {row[col]!r}") from None

        status = row.get("status", "")
        if status and not status.isdigit():
            raise ValueError(f"{where}: field 'status': expected an HTTP status code, got {status!r}")
        ok = not status or int(status) < 400
        cols["sent"].append(_start_time(row["start_time"], where))
        cols["prompt"].append(_int(number("prompt_tokens"), where, "prompt_tokens", int(ok)))
        cols["output"].append(_int(number("completion_tokens"), where, "completion_tokens", 0))
        cols["ok"].append(ok)
        group = row.get("prefix_group", "")
        cols["group"].append(groups.setdefault(group, len(groups)) if group else -1)
        if not ok:
            cols["ttft"].append(math.nan)
            cols["e2e"].append(math.nan)
            continue
        ttft = _seconds(number("ttft_ms"), where, "ttft_ms") / 1e3
        e2e = _seconds(number("duration_ms"), where, "duration_ms") / 1e3
        _check_latencies(where, ttft, e2e)
        cols["ttft"].append(ttft)
        cols["e2e"].append(e2e)
    return _finish(
        str(path),
        "gateway-csv",
        cols["sent"],
        cols["prompt"],
        cols["output"],
        cols["ok"],
        cols["ttft"],
        cols["e2e"],
        cols["group"],
    )


# --- dispatch ------------------------------------------------------------------------------------


def detect_format(path: str | Path) -> str:
    """The format of ``path`` from its content: a JSON object with ``requests`` (inference-sim) or
    ``start_times`` (vllm), a JSON list (inference-perf), anything else read as the gateway CSV."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    with path.open("rb") as handle:
        head = handle.read(4096).lstrip()
    if head.startswith(b"["):
        return "inference-perf"
    if head.startswith(b"{"):
        data = _read_json(path)
        if isinstance(data, dict) and "requests" in data:
            return "inference-sim"
        if isinstance(data, dict) and any(k in data for k in _VLLM_LISTS):
            return "vllm"
        raise ValueError(
            f"{path}: a JSON object that is neither the inference-sim format ('requests') nor vllm bench "
            "serve's ('start_times', 'ttfts', ...); name the format with --format"
        )
    return "gateway-csv"


def read_log(path: str | Path, fmt: str = "auto", truth: str | Path | None = None) -> ServingLog:
    """Read a request log in ``fmt`` (one of `FORMATS`, or ``auto`` to detect it)."""
    if fmt == "auto":
        fmt = detect_format(path)
    if fmt not in FORMATS:
        raise ValueError(f"unknown log format {fmt!r}; known: auto, {', '.join(FORMATS)}")
    if truth is not None and fmt != "inference-sim":
        raise ValueError(f"--truth applies to the inference-sim format only, not {fmt}")
    if fmt == "inference-sim":
        return read_inference_sim(path, truth)
    if fmt == "vllm":
        return read_vllm_bench(path)
    if fmt == "inference-perf":
        return read_inference_perf(path)
    return read_gateway_csv(path)
