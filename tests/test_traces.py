"""Trace loaders (burstgym/traces.py): parsing, format detection, and errors that name file and line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import numpy as np
import pytest

from burstgym.workload import TraceReplay, Workload
from burstgym.workload.traces import detect_format, load_trace, summary

SHARED_DATA = Path(
    os.environ.get("BURSTGYM_SHARED_DATA", Path(__file__).resolve().parents[1].parent / "shared" / "data")
)
AZURE_CODE = SHARED_DATA / "traces" / "azure_llm_2023_code.csv"

AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
BURSTGPT_HEADER = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_azure_csv_sorted_from_zero(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "azure.csv",
        AZURE_HEADER
        + "2023-11-16 18:15:47.0000000,30,0\n"  # output 0 is clamped to 1
        + "2023-11-16 18:15:46.6805900,1200,13\n"
        + "\n"  # blank lines are skipped
        + "2023-11-16 18:15:46.6805900,7,2\n",
    )
    trace = load_trace(path)
    np.testing.assert_allclose(trace.arrival, [0.0, 0.0, 0.31941])
    np.testing.assert_array_equal(trace.prompt, [1200, 7, 30])  # stable sort keeps file order on ties
    np.testing.assert_array_equal(trace.output, [13, 2, 1])
    assert trace.prompt.dtype == trace.output.dtype == np.int32


def test_burstgpt_csv_drops_failed_requests(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "burst.csv",
        BURSTGPT_HEADER
        + "5,ChatGPT,472,18,490,Conversation log\n"
        + "8,ChatGPT,1000,0,1000,Conversation log\n"
        + "12,GPT-4,85,200,285,API log\n",
    )
    trace = load_trace(path)
    np.testing.assert_allclose(trace.arrival, [0.0, 7.0])
    np.testing.assert_array_equal(trace.prompt, [472, 85])
    np.testing.assert_array_equal(trace.output, [18, 200])


def test_mooncake_jsonl(tmp_path: Path) -> None:
    records = [
        {"timestamp": 2500, "input_length": 1000, "output_length": 12, "hash_ids": [57, 91]},
        {"timestamp": 1000, "input_length": 512, "output_length": 40, "hash_ids": [57]},
    ]
    path = _write(tmp_path, "mc.jsonl", "\n".join(json.dumps(r) for r in records) + "\n")
    trace = load_trace(path)
    np.testing.assert_allclose(trace.arrival, [0.0, 1.5])
    np.testing.assert_array_equal(trace.prompt, [512, 1000])
    np.testing.assert_array_equal(trace.output, [40, 12])
    # Block ids renumbered densely in order of first appearance, -1 past a prompt's blocks.
    np.testing.assert_array_equal(trace.hash_ids, [[0, -1], [0, 1]])
    assert trace.block_tokens == 512


@pytest.mark.parametrize(
    ("record", "match"),
    [
        ({"timestamp": 0, "input_length": 600, "output_length": 1}, r"line 2: field 'hash_ids': missing"),
        (
            {"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]},
            r"line 2: field 'hash_ids': 1 ids for input_length 600, expected ceil\(600 / 512\) = 2",
        ),
        (
            {"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, "x"]},
            r"line 2: field 'hash_ids': expected a list of integers",
        ),
        (
            {"timestamp": 0, "input_length": 2000, "output_length": 1, "hash_ids": [1, 2, 3, 4]},
            r"line 2: .*4 .*bound.* 3|line 2: .*max_blocks",
        ),
    ],
)
def test_mooncake_hash_id_errors_name_file_line_and_bound(tmp_path: Path, record: dict, match: str) -> None:
    good = {"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}
    path = _write(tmp_path, "bad.jsonl", json.dumps(good) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(ValueError, match=match) as error:
        load_trace(path, max_blocks=3)
    assert str(path) in str(error.value)


def test_format_detection_and_explicit_format(tmp_path: Path) -> None:
    azure = _write(tmp_path, "a.txt", AZURE_HEADER + "2023-11-16 18:15:46,5,5\n2023-11-16 18:15:48,5,5\n")
    assert detect_format(azure) == "azure"
    assert detect_format(_write(tmp_path, "b.csv", BURSTGPT_HEADER)) == "burstgpt"
    assert detect_format(tmp_path / "c.jsonl") == "mooncake"
    with pytest.raises(ValueError, match="fmt="):
        detect_format(_write(tmp_path, "d.csv", "when,prompt,output\n1,2,3\n"))
    assert load_trace(azure, fmt="azure").arrival[-1] == 2.0
    with pytest.raises(ValueError, match="unknown trace format"):
        load_trace(azure, fmt="parquet")


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", r"empty file"),
        (AZURE_HEADER, r"empty file"),
        (
            "TIMESTAMP,ContextTokens\n2023-11-16 18:15:46,5\n",
            r"line 1: missing column\(s\) \['GeneratedTokens'\]",
        ),
        (
            AZURE_HEADER + "2023-11-16 18:15:46,5,5\n" * 15 + "2023-11-16 18:15:47,abc,5\n",
            r"line 17: column 'ContextTokens': not a number: 'abc'",
        ),
        (
            AZURE_HEADER + "2023-11-16 18:15:46,5,5\nyesterday,5,5\n",
            r"line 3: column 'TIMESTAMP': not a timestamp: 'yesterday'",
        ),
        (
            AZURE_HEADER + "2023-11-16 18:15:46,5,5\n2023-11-16 18:15:47,0,5\n",
            r"line 3: column 'ContextTokens': token count below 1",
        ),
        (
            AZURE_HEADER + "2023-11-16 18:15:46,5,-2\n",
            r"line 2: column 'GeneratedTokens': token count below 0",
        ),
        (AZURE_HEADER + "2023-11-16 18:15:46,5.5,2\n", r"line 2: column 'ContextTokens': not a whole number"),
        (
            AZURE_HEADER + "2023-11-16 18:15:46,5,2\n2023-11-16 18:15:47,5\n",
            r"line 3: column 'GeneratedTokens': not a number: ''",
        ),
        (AZURE_HEADER + "2023-11-16 18:15:46,5,2,9\n", r"line 2: more fields than the header"),
        (AZURE_HEADER + "2023-11-16 18:15:46,5,2\n2023-11-16 18:15:46,5,2,9\n", r"line 3, saw 4"),
    ],
)
def test_azure_errors_name_file_line_and_column(tmp_path: Path, text: str, match: str) -> None:
    path = _write(tmp_path, "bad.csv", text)
    with pytest.raises(ValueError, match=match) as error:
        load_trace(path, fmt="azure")
    assert str(path) in str(error.value)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (
            BURSTGPT_HEADER + "1,ChatGPT,10,5,15,API log\nsoon,ChatGPT,10,5,15,API log\n",
            r"line 3: column 'Timestamp': not a number",
        ),
        (
            BURSTGPT_HEADER + "1,ChatGPT,-3,5,2,API log\n",
            r"line 2: column 'Request tokens': token count below 1",
        ),
        (BURSTGPT_HEADER + "1,ChatGPT,10,0,10,API log\n", r"no successful request"),
    ],
)
def test_burstgpt_errors(tmp_path: Path, text: str, match: str) -> None:
    path = _write(tmp_path, "bad.csv", text)
    with pytest.raises(ValueError, match=match) as error:
        load_trace(path, fmt="burstgpt")
    assert str(path) in str(error.value)


@pytest.mark.parametrize(
    ("lines", "match"),
    [
        ([], r"empty file"),
        (
            ['{"timestamp": 1, "input_length": 5, "output_length": 5, "hash_ids": [0]}', "{oops"],
            r"line 2: not valid JSON",
        ),
        (["[1, 2, 3]"], r"line 1: expected a JSON object"),
        (['{"timestamp": 1, "output_length": 5}'], r"line 1: field 'input_length': missing"),
        (
            ['{"timestamp": "noon", "input_length": 5, "output_length": 5}'],
            r"line 1: field 'timestamp': not a number",
        ),
        (
            ["", '{"timestamp": 1, "input_length": 0, "output_length": 5}'],
            r"line 2: field 'input_length': token count below 1",
        ),
        (
            ['{"timestamp": 1, "input_length": 5, "output_length": 2.5}'],
            r"line 1: field 'output_length': not a whole number",
        ),
    ],
)
def test_mooncake_errors(tmp_path: Path, lines: list[str], match: str) -> None:
    path = _write(tmp_path, "bad.jsonl", "\n".join(lines))
    with pytest.raises(ValueError, match=match) as error:
        load_trace(path)
    assert str(path) in str(error.value)


@pytest.fixture(scope="module")
def azure_code():
    if not AZURE_CODE.exists():
        pytest.skip(f"shared trace data not found at {AZURE_CODE} (set BURSTGYM_SHARED_DATA)")
    return load_trace(AZURE_CODE)


def test_real_azure_code_trace(azure_code) -> None:
    stats = summary(azure_code)
    assert stats["requests"] == 8819  # the file has no zero-token rows, so nothing is clamped
    assert stats["mean_rate"] == pytest.approx(2.566, rel=1e-3)
    assert stats["interarrival_cv"] == pytest.approx(13.15, rel=1e-2)
    assert (stats["prompt_median"], stats["output_median"]) == (1469.0, 13.0)
    assert azure_code.arrival[0] == 0.0 and np.all(np.diff(azure_code.arrival) >= 0)


def test_real_trace_replay_reproduces_scaled_gaps_and_pairs(azure_code) -> None:
    replay = TraceReplay(azure_code, rate=10.0)
    with jax.disable_jit():
        requests = Workload(replay).sample(jax.random.PRNGKey(3), 500)
        rows = np.asarray(replay.window(jax.random.split(jax.random.PRNGKey(3), 3)[0], 500))
    wrap_gap = azure_code.arrival[-1] / (azure_code.arrival.size - 1)  # from the last request to the first
    gaps = np.append(np.diff(azure_code.arrival), wrap_gap)[rows[:-1]] * replay.native_rate / 10.0
    np.testing.assert_allclose(np.diff(requests.arrival), gaps, rtol=1e-3, atol=1e-4)
    np.testing.assert_array_equal(requests.prompt, azure_code.prompt[rows])
    np.testing.assert_array_equal(requests.output, azure_code.output[rows])


def test_paths_that_are_not_text_traces_are_refused_naming_the_file(tmp_path: Path) -> None:
    """A directory, a gzip archive (under any name), binary data and non-UTF-8 text are refused in
    one line naming the file (before: IsADirectoryError, UnicodeDecodeError without the file)."""
    import gzip

    row = b'{"timestamp": 0, "input_length": 5, "output_length": 5, "hash_ids": [0]}\n'
    cases = {
        tmp_path / "a_dir": "a directory",
        tmp_path / "t.jsonl": "gzip-compressed",
        tmp_path / "t.csv.gz": "gzip-compressed",
        tmp_path / "bin.csv": "binary data",
        tmp_path / "latin.csv": "not UTF-8 text",
    }
    (tmp_path / "a_dir").mkdir()
    (tmp_path / "t.jsonl").write_bytes(gzip.compress(row))
    (tmp_path / "t.csv.gz").write_bytes(gzip.compress(AZURE_HEADER.encode()))
    (tmp_path / "bin.csv").write_bytes(bytes(range(256)))
    latin = "2023-11-16 18:15:46,1\xe9,5\n".encode("latin-1")
    (tmp_path / "latin.csv").write_bytes(AZURE_HEADER.encode() + latin)
    for path, why in cases.items():
        with pytest.raises(ValueError) as error:
            load_trace(path)
        assert str(error.value).startswith(f"{path}: {why}") and "\n" not in str(error.value), path
    with pytest.raises(FileNotFoundError, match="missing.csv"):
        load_trace(tmp_path / "missing.csv")


@pytest.mark.parametrize(
    ("ids", "match"),
    [
        ([-3, 4], r"line 2: field 'hash_ids': block id -3 is outside"),  # was silently dropped
        ([12345678901234567890123, 4], r"line 2: field 'hash_ids': block id 12345678901234567890123"),
        ([2**63, 4], r"line 2: field 'hash_ids': block id 9223372036854775808"),
    ],
)
def test_negative_or_oversized_hash_ids_are_refused_naming_file_and_line(tmp_path: Path, ids, match) -> None:
    good = {"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}
    bad = {"timestamp": 1, "input_length": 600, "output_length": 1, "hash_ids": ids}
    path = _write(tmp_path, "ids.jsonl", json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(ValueError, match=match) as error:
        load_trace(path)
    assert str(error.value).startswith(str(path))
    ok = {**bad, "hash_ids": [2**63 - 1, 5]}
    path = _write(tmp_path, "ok.jsonl", json.dumps(good) + "\n" + json.dumps(ok) + "\n")
    assert load_trace(path).hash_ids.tolist() == [[0, -1], [1, 2]]


def test_token_counts_beyond_int32_are_refused_not_wrapped(tmp_path: Path) -> None:
    """A prompt of 4,294,967,396 tokens became 100 in the core's int32; it is refused naming file,
    line and column or field."""
    rows = "2023-11-16 18:15:46.1,4294967396,5\n2023-11-16 18:15:47.1,100,5\n"
    csv = _write(tmp_path, "big.csv", AZURE_HEADER + rows)
    with pytest.raises(ValueError, match=r"big\.csv: line 2: column 'ContextTokens': token count above"):
        load_trace(csv)
    row = {"timestamp": 0, "input_length": 100, "output_length": 2**31, "hash_ids": [0]}
    jsonl = _write(tmp_path, "big.jsonl", json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=r"big\.jsonl: line 1: field 'output_length': token count above"):
        load_trace(jsonl)
    # integers beyond int64 and beyond any float (a TypeError from NumPy before)
    row = {"timestamp": 0, "input_length": 10**23, "output_length": 1, "hash_ids": [0]}
    jsonl = _write(tmp_path, "huge.jsonl", json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=r"huge\.jsonl: line 1: field 'input_length': token count above"):
        load_trace(jsonl)
    row = {"timestamp": 10**400, "input_length": 1, "output_length": 1, "hash_ids": [0]}
    jsonl = _write(tmp_path, "late.jsonl", json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=r"late\.jsonl: line 1: field 'timestamp': not a finite number"):
        load_trace(jsonl)
