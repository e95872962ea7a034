"""Fuzzing the inputs users give (hypothesis): scenario settings and trace rows either are refused
with a one-line ValueError naming the field (or the file and line), or give a valid episode;
never a wrapped integer, a raw TypeError, a traceback from JAX or anything else.

Three tests, sized for CI (numbers of examples below; no deadline, the first examples compile):
- settings through `scenarios.make` (validation, capacity, parameters): integer settings reach
  the core unwrapped and every parameter is finite;
- settings that change only the core's parameters, run as whole episodes through `gym.make` on
  one compiled configuration: every request is served or dropped, rewards are finite;
- Mooncake trace rows through loading, `make("trace", ...)` and the episode's request stream as
  the JAX sampler draws it: the rows' token counts and block ids arrive as written.
"""

from __future__ import annotations

import json
import math
import re
import tempfile
from pathlib import Path

import gymnasium as gym
import numpy as np
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import burstgym  # noqa: F401  (registers BurstBalance-v0)
from burstgym import scenarios
from burstgym.workload import load_trace

SETTINGS_EXAMPLES, EPISODE_EXAMPLES, TRACE_EXAMPLES = 200, 25, 100
FUZZ = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)

INT32 = 2**31 - 1
EDGE_INTS = [0, 1, -1, 2, 7, 64, INT32, INT32 + 1, 2**32 + 5, 2**63, -(2**63), 10**23]
EDGE_FLOATS = [0.0, -0.0, 1e-45, 1e-300, 0.5, 1.0, 3.0, 1e39, 1e300, math.inf, -math.inf, math.nan]


def junk() -> st.SearchStrategy:
    """Values of the wrong kind: strings (numeric ones too), bools, None, containers, NumPy bools."""
    return st.one_of(
        st.sampled_from(["", "0.5", "512", "inf", "steady", "1e3", "True"]),
        st.booleans(),
        st.just(np.bool_(True)),
        st.none(),
        st.lists(st.integers(0, 4), max_size=3),
        st.tuples(st.floats(0, 2), st.floats(0, 2)),
        st.just({"a": 1}),
    )


def number() -> st.SearchStrategy:
    """Numbers of every kind and size: Python and NumPy ints and floats, edge values included."""
    return st.one_of(
        st.integers(1, 64),
        st.floats(0.01, 4.0),
        st.sampled_from(EDGE_INTS),
        st.sampled_from(EDGE_FLOATS),
        st.integers(-(2**70), 2**70),
        st.floats(allow_nan=True, allow_infinity=True),
        st.integers(1, 64).map(np.int64),
        st.floats(0.125, 4.0, width=32).map(np.float32),
        st.integers(1, 64).map(float),  # whole numbers given as floats
    )


def value() -> st.SearchStrategy:
    return st.one_of(number(), number(), junk())


# Every setting but the trace path and the batching regime (a dynamic-batching capacity estimate
# takes seconds per example; its settings are still fuzzed, unused, under continuous batching).
FIELDS = sorted(f for f in scenarios.Settings.__dataclass_fields__ if f not in ("trace", "scheduler"))


def names_one_of(message: str, fields) -> bool:
    return any(re.search(rf"\b{re.escape(f)}\b", message) for f in fields)


def check_refusal(error: ValueError, fields) -> None:
    """One line, naming one of the settings that were given."""
    message = str(error)
    assert "\n" not in message, message
    assert names_one_of(message, fields), f"{message!r} names none of {sorted(fields)}"


@settings(max_examples=SETTINGS_EXAMPLES, **FUZZ)
@given(
    scenario=st.sampled_from(["steady", "steady", "steady", "prefix"]),
    overrides=st.dictionaries(st.sampled_from(FIELDS), value(), min_size=1, max_size=3),
)
def test_settings_are_refused_by_name_or_reach_the_core_intact(scenario, overrides) -> None:
    base = {"episode_length": 8, "n_nodes": 2}
    try:
        cfg, params = scenarios.make(scenario, **{**base, **overrides})
    except ValueError as e:
        check_refusal(e, overrides)
        event("refused")
        return
    event("valid")
    _, s = scenarios.settings_for(scenario, **{**base, **overrides})
    for name in ("max_num_seqs", "max_num_batched_tokens", "queue_capacity"):
        want = getattr(s, name)
        if want is not None:
            assert np.asarray(getattr(params.nodes, name)).tolist() == [want] * s.n_nodes, name
    assert cfg.n_nodes == s.n_nodes and cfg.episode_length == s.episode_length
    for leaf in (params.arrival_rate, params.capacity_rate, params.reward_scale, params.drop_penalty):
        assert np.isfinite(np.asarray(leaf)).all()


# Settings that change only the core's parameters (never the compiled configuration), with values
# that keep the slot table at the episode's 8 requests.
PARAM_FIELDS = {
    "load": number(),
    "speed": st.one_of(number(), st.tuples(number(), number())),
    "max_num_seqs": st.one_of(st.integers(8, INT32), st.sampled_from(EDGE_INTS)),
    "max_num_batched_tokens": number(),
    "queue_capacity": st.one_of(st.integers(8, INT32), st.sampled_from(EDGE_INTS)),
    "drop_penalty": number(),
    "ttft_slo": number(),
    "tpot_slo": number(),
    "reward_scale": st.one_of(st.floats(1e-3, 1e3), number()),
    "energy_weight": number(),
    "ttft_weight": number(),
    "rate_window": number(),
    "sleep_timeout": number(),
    "wake_delay": number(),
    "sleep_power_fraction": number(),
}


def episode(env) -> dict:
    """Route round-robin to the end of the episode; the final info's metrics and the rewards."""
    env.reset(seed=0)
    rewards, k, done = [], 0, False
    while not done:
        _, reward, terminated, truncated, info = env.step(k % env.action_space.n)
        rewards.append(reward)
        k += 1
        done = terminated or truncated
    assert terminated and k == 8
    return {"rewards": np.asarray(rewards), **info["metrics"]}


@settings(max_examples=EPISODE_EXAMPLES, **FUZZ)
@given(
    overrides=st.sets(st.sampled_from(sorted(PARAM_FIELDS)), min_size=1, max_size=3).flatmap(
        lambda names: st.fixed_dictionaries({k: PARAM_FIELDS[k] for k in names})
    )
)
def test_parameter_settings_give_valid_episodes_or_clear_refusals(overrides) -> None:
    try:
        env = gym.make("BurstBalance-v0", scenario="steady", episode_length=8, n_nodes=2, **overrides)
    except ValueError as e:
        check_refusal(e, overrides)
        event("refused")
        return
    event("valid episode")
    m = episode(env)
    assert np.isfinite(m["rewards"]).all() and m["requests"] == 8
    assert m["served"] + m["drops"] == 8  # drained: every request served or dropped


JSON_JUNK = st.one_of(
    st.sampled_from(["", "12", "noon"]), st.booleans(), st.none(), st.lists(st.integers(0, 4), max_size=2)
)
TOKENS = st.one_of(st.integers(1, 2000), st.sampled_from(EDGE_INTS), st.sampled_from(EDGE_FLOATS), JSON_JUNK)
TIMES = st.one_of(st.integers(0, 10**6), st.floats(0, 1e6), st.sampled_from(EDGE_FLOATS), JSON_JUNK)
IDS = st.one_of(st.integers(0, 50), st.sampled_from(EDGE_INTS), JSON_JUNK)


@st.composite
def rows(draw) -> list[dict]:
    """Mooncake rows: mostly well formed (one block id per 512-token block; a row may share the
    first row's leading full blocks, a shared prefix), some fields fuzzed."""
    out, first = [], None  # first: the first row's prompt and ids, as generated
    for i in range(draw(st.integers(1, 6))):
        prompt = draw(st.integers(1, 1500))
        ids = [100 * i + j for j in range(-(-prompt // 512))]
        if first is not None and draw(st.booleans()):
            shared = min(prompt, first[0]) // 512  # whole blocks only: an id names one block content
            ids[:shared] = first[1][:shared]
        first = first or (prompt, ids)
        row = {
            "timestamp": float(i) * draw(st.floats(0.1, 100)),
            "input_length": prompt,
            "output_length": draw(st.integers(0, 300)),
            "hash_ids": ids,
        }
        if draw(st.booleans()):
            field = draw(st.sampled_from(["timestamp", "input_length", "output_length", "hash_ids"]))
            if field == "timestamp":
                row[field] = draw(TIMES)
            elif field == "hash_ids":
                row[field] = draw(st.one_of(st.lists(IDS, max_size=4), JSON_JUNK))
            else:
                row[field] = draw(TOKENS)
        out.append(row)
    return out


@settings(max_examples=TRACE_EXAMPLES, **FUZZ)
@given(records=rows())
def test_trace_rows_are_refused_by_file_and_line_or_replayed_as_written(records) -> None:
    import jax

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fuzz.jsonl"
        # NaN and infinities as JSON's extensions (NaN, Infinity), as Python's json writes them
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        try:
            trace = load_trace(path)
            cfg, _ = scenarios.make("trace", trace=str(path), episode_length=8, n_nodes=2)
        except ValueError as e:
            message = str(e)
            assert "\n" not in message and message.startswith(str(path)), message
            event("refused")
            return
        event("replayed")
        stream = cfg.workload.sample(jax.random.key(0), 8)
        rows_by_prompt = {int(p) for p in trace.prompt}
        assert {int(p) for p in np.asarray(stream.prompt)} <= rows_by_prompt  # no wrapped lengths
        assert set(np.asarray(stream.output).tolist()) <= {max(int(o), 1) for o in trace.output}
        assert set(trace.prompt.tolist()) == {int(r["input_length"]) for r in records}
        ids = np.asarray(stream.chunk_ids)
        assert ids.min() >= -1 and ids.max() < np.asarray(stream.chunk_tokens).shape[0]
