"""Tests of the plain-Python reference simulator against hand-traced cases and queueing theory:
both schedulers (dynamic with and without padding), preemption, the prefix cache (LRU eviction,
the hit cap, per-node caches, shared pinned chunks), sleep, the energy roofline, both episode ends,
both reward timings and the three objectives, and bad input refused with the field named.

Most cases use a latency model with dyadic coefficients (exact in binary floating point), so hand
sums of iteration durations equal the simulator's times exactly:
``d = 2^-6 + 2^-10 * tokens + [decode] (2^-8 + 2^-12 * kv_tokens) + [prefill] 2^-16 * pairs``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from burstgym import reference
from burstgym.latency import LatencyModel, PowerModel, energy_j, step_time
from burstgym.reference import RefNode, simulate

_ZERO = dict.fromkeys(LatencyModel._fields, 0.0)
LM = LatencyModel(
    **{
        **_ZERO,
        "overhead_s": 2.0**-6,
        "token_s": 2.0**-10,
        "knee_p": 1.0,
        "tile_tokens": 1.0,
        "attn_fixed_s": 2.0**-8,
        "kv_token_s": 2.0**-12,
        "prefill_pair_s": 2.0**-16,
    }
)


def d(prefill_tokens: int, decode_seqs: int, kv_tokens: int, pairs: float) -> float:
    """Hand formula of one iteration's duration under `LM`."""
    t = 2.0**-6 + 2.0**-10 * (prefill_tokens + decode_seqs)
    if decode_seqs:
        t += 2.0**-8 + 2.0**-12 * kv_tokens
    if prefill_tokens:
        t += 2.0**-16 * pairs
    return t


def flat(idle_w: float = 100.0, busy_w: float = 700.0) -> PowerModel:
    """A node that draws `busy_w` whenever an iteration runs, whatever its work."""
    return PowerModel(idle_w, busy_w, busy_w, 0.0, 0.0, 0.0, 0.0)


def cont(**kw) -> RefNode:
    return RefNode(scheduler="continuous", latency=LM, **kw)


def dyn(**kw) -> RefNode:
    return RefNode(scheduler="dynamic", latency=LM, **kw)


def test_step_time_matches_latency_module() -> None:
    rng = np.random.default_rng(1)
    for _ in range(20):
        lm = LatencyModel(**{k: float(rng.uniform(1e-6, 1e-2)) for k in LatencyModel._fields})
        lm = lm._replace(
            knee_p=float(rng.uniform(1.0, 8.0)),
            weights_s=float(rng.uniform(1e-3, 1e-2)),
            tile_tokens=float(rng.choice([1, 16, 64])),
        )
        for pt, ds, kv in [(0, 0, 0), (100, 0, 0), (0, 7, 900), (37, 3, 120), (2000, 60, 40_000)]:
            pairs = pt * (pt + 1) / 2
            want = float(step_time(lm, pt, ds, kv, pairs))
            assert reference._step_time(lm, pt, ds, kv, pairs) == pytest.approx(want, rel=2e-5, abs=1e-12)


def test_energy_matches_power_module() -> None:
    rng = np.random.default_rng(2)
    for _ in range(20):
        pw = PowerModel(*(float(x) for x in rng.uniform(0.0, 1.0, 7)))
        pw = pw._replace(idle_w=100.0, static_w=300.0, tdp_w=float(rng.choice([400.0, 1e9])))
        for dur, tok, kv, pairs in [(0.01, 100, 0, 5050), (0.02, 7, 900, 0), (0.5, 2000, 4e4, 2e6)]:
            want = float(energy_j(pw, dur, tok, kv, pairs, 1))
            assert reference._energy(pw, dur, tok, kv, pairs) == pytest.approx(want, rel=2e-5)


def test_single_request_continuous() -> None:
    r = simulate([cont(speed=2.0)], [0.5], [10], [3], [0])
    ttft = 2 * d(10, 0, 0, 10 * 11 / 2)
    assert r.ttft[0] == ttft
    assert r.first_token_time[0] == 0.5 + ttft
    assert r.finish_time[0] == 0.5 + ttft + 2 * d(0, 1, 10, 0) + 2 * d(0, 1, 11, 0)
    assert r.tpot[0] == (r.finish_time[0] - r.first_token_time[0]) / 2
    assert r.t_end == r.finish_time[0]
    assert r.busy_s[0] == pytest.approx(r.e2e_latency[0])


def test_chunked_prefill_under_token_budget() -> None:
    # budget 4: the 10-token prompt runs as chunks 4, 4, 2 with attention pairs c * (p + (c + 1) / 2)
    r = simulate([cont(max_num_batched_tokens=4)], [0.0], [10], [2], [0])
    ttft = d(4, 0, 0, 4 * 2.5) + d(4, 0, 0, 4 * (4 + 2.5)) + d(2, 0, 0, 2 * (8 + 1.5))
    assert r.ttft[0] == ttft
    assert r.e2e_latency[0] == ttft + d(0, 1, 10, 0)


def test_arrival_during_prefill_shares_budget_and_waits() -> None:
    # request 1 arrives while request 0 prefills; it is admitted at the next iteration, alongside 0's decode
    r = simulate([cont()], [0.0, 0.001], [8, 6], [2, 1], [0, 0])
    d1 = d(8, 0, 0, 36)
    d2 = d(6, 1, 8, 21)
    assert r.finish_time[0] == d1 + d2
    assert r.finish_time[1] == d1 + d2
    assert r.ttft[1] == d1 + d2 - 0.001


def test_dynamic_batch_waits_for_max_queue_delay() -> None:
    node = dyn(max_batch_size=4, max_queue_delay=0.05, padding=False)
    r = simulate([node], [0.0, 0.01], [10, 6], [1, 2], [0, 0])
    prefill = d(16, 0, 0, 55 + 21)
    assert r.first_token_time.tolist() == [0.05 + prefill, 0.05 + prefill]
    assert r.finish_time[0] == 0.05 + prefill
    assert r.finish_time[1] == 0.05 + prefill + d(0, 1, 6, 0)


def test_dynamic_full_batch_launches_at_once() -> None:
    node = dyn(max_batch_size=2, max_queue_delay=10.0, padding=False)
    r = simulate([node], [0.0, 0.01, 0.02], [10, 6, 4], [2, 1, 1], [0, 0, 0])
    prefill = d(16, 0, 0, 55 + 21)
    batch_end = 0.01 + prefill + d(0, 1, 10, 0)  # the batch holds the node until its last member ends
    assert r.first_token_time[:2].tolist() == [0.01 + prefill] * 2
    assert r.finish_time[0] == batch_end
    # request 2 waits alone: it launches at max(batch end, its arrival + max_queue_delay)
    assert r.first_token_time[2] == (0.02 + 10.0) + d(4, 0, 0, 10)
    assert batch_end < 0.02 + 10.0


def test_dynamic_one_token_prompt_counts_as_decoding() -> None:
    r = simulate([dyn(max_batch_size=2, padding=False)], [0.0, 0.0], [1, 5], [1, 1], [0, 0])
    assert r.ttft.tolist() == [d(5, 1, 0, 15)] * 2


def test_drop_when_waiting_queue_full() -> None:
    # queue_capacity 1: request 1 waits behind the batch in flight, request 2 finds it full
    node = dyn(max_batch_size=1, queue_capacity=1)
    r = simulate([node], [0.0, 0.0, 0.0], [4, 4, 4], [1, 1, 1], [0, 0, 0], drop_penalty=7.0)
    assert r.dropped.tolist() == [False, False, True]
    assert np.isnan(r.ttft[2]) and np.isnan(r.e2e_latency[2])
    assert r.objective == pytest.approx(np.nansum(r.e2e_latency) + 7.0)


def test_iteration_ending_at_arrival_completes_first() -> None:
    # the iteration of request 0 ends exactly when request 2 arrives; it completes first, so
    # request 1 leaves the queue before request 2 is routed and request 2 is not dropped
    one = d(4, 0, 0, 10)
    node = dyn(max_batch_size=1, queue_capacity=1)
    r = simulate([node], [0.0, 0.0, one], [4, 4, 4], [1, 1, 1], [0, 0, 0])
    assert not r.dropped.any()
    assert r.finish_time.tolist() == [one, 2 * one, 3 * one]


def test_preemption_recomputes_prompt_and_generated_tokens() -> None:
    # 4 KV blocks of 4 tokens; two requests of P=4, O=8. Hand trace (c = computed, g = generated):
    # it1 A prefill 4. it2 A decode (kv 4) + B prefill 4. it3-5 both decode. it6: A needs a 3rd
    # block, none free: B (most recent) is preempted, A decodes alone; it7-8 B (8 tokens, 2 blocks)
    # does not fit in the 1 free block; A finishes at the end of it8. it9 B recomputes 8 tokens and
    # gets its 5th token; it10-12 B decodes to 8 tokens.
    node = cont(block_size=4, kv_blocks=4)
    r = simulate([node], [0.0, 0.0], [4, 4], [8, 8], [0, 0])
    it = [
        d(4, 0, 0, 10),
        d(4, 1, 4, 10),
        d(0, 2, 9, 0),
        d(0, 2, 11, 0),
        d(0, 2, 13, 0),
        d(0, 1, 8, 0),
        d(0, 1, 9, 0),
        d(0, 1, 10, 0),
        d(8, 0, 0, 36),
        d(0, 1, 8, 0),
        d(0, 1, 9, 0),
        d(0, 1, 10, 0),
    ]
    ends = np.cumsum(it)
    assert r.ttft.tolist() == [ends[0], ends[1]]
    assert r.finish_time[0] == pytest.approx(ends[7], rel=1e-15)
    assert r.finish_time[1] == pytest.approx(ends[11], rel=1e-15)
    assert r.preemptions.tolist() == [0, 1]
    assert r.total_preemptions == 1


def test_preempted_request_goes_to_queue_head() -> None:
    # as above, plus C (P=4, O=1) waiting since t=0: after B's preemption C is blocked behind B
    # (FCFS head-of-line), so C runs only with B's recompute, after A finishes
    node = cont(block_size=4, kv_blocks=4, max_num_seqs=2)
    r = simulate([node], [0.0, 0.0, 0.0], [4, 4, 4], [8, 8, 1], [0, 0, 0])
    assert r.preemptions.tolist() == [0, 1, 0]
    assert r.first_token_time[2] > r.finish_time[0]
    # B's recompute (8 tokens) and C's prompt (4 tokens) share the iteration after A finishes
    assert r.first_token_time[2] == pytest.approx(r.finish_time[0] + d(12, 0, 0, 36 + 10), rel=1e-15)


def test_sleep_then_wake_delay_and_energy() -> None:
    node = cont(sleep_timeout=1.0, wake_delay=0.5, power=flat(100.0, 700.0), sleep_power_w=30.0)
    r = simulate([node, node], [0.0, 5.0], [10, 10], [1, 1], [0, 0], energy_weight=0.01)
    one = d(10, 0, 0, 55)
    assert r.finish_time[0] == one
    assert r.ttft[1] == 0.5 + one  # asleep since one + 1.0, woken at 5.0, runs from 5.5
    assert r.t_end == 5.5 + one
    e0 = 700 * 2 * one + 100 * (1.0 + 0.5) + 30 * (5.0 - (one + 1.0))
    e1 = 100 * 1.0 + 30 * (r.t_end - 1.0)  # the unused node sleeps from 1.0
    assert r.energy_j.tolist() == pytest.approx([e0, e1], rel=1e-12)
    assert r.objective == pytest.approx(np.sum(r.e2e_latency) + 0.01 * (e0 + e1), rel=1e-12)


def _mixed_episode(
    energy_weight: float, reward: str = "accrual"
) -> tuple[reference.RefResult, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    e = 3000
    arrival = np.round(np.cumsum(rng.exponential(0.02, e)), 3)  # rounding makes simultaneous arrivals
    prompt = rng.integers(1, 300, e)
    output = rng.integers(1, 120, e)
    lm = LatencyModel(
        **{
            **_ZERO,
            "overhead_s": 3e-3,
            "kernel_fixed_s": 1e-3,
            "weights_s": 5.5e-3,
            "token_s": 2e-5,
            "knee_p": 4.0,
            "tile_tokens": 16.0,
            "attn_fixed_s": 3e-4,
            "attn_seq_s": 3e-5,
            "kv_token_s": 2.4e-7,
            "prefill_fixed_s": 1e-4,
            "prefill_pair_s": 1.3e-9,
        }
    )
    nodes = [
        RefNode("continuous", lm, kv_blocks=64, max_num_batched_tokens=256, queue_capacity=20),
        RefNode("dynamic", lm, queue_capacity=10, sleep_timeout=0.5, wake_delay=0.3),
        RefNode("continuous", lm, speed=1.5, sleep_timeout=0.2, wake_delay=0.1),
    ]
    actions = rng.choice(3, e, p=[0.5, 0.3, 0.2])
    r = simulate(
        nodes,
        arrival,
        prompt,
        output,
        actions,
        drop_penalty=5.0,
        energy_weight=energy_weight,
        ttft_slo=0.5,
        tpot_slo=0.05,
        reward=reward,
    )
    return r, arrival, output


def test_drain_and_invariants() -> None:
    r, arrival, _ = _mixed_episode(1e-4)
    served = ~r.dropped
    assert r.dropped.sum() > 0 and r.total_preemptions > 0  # the episode exercises both
    assert np.isfinite(r.finish_time[served]).all()  # everything accepted finished in the drain
    assert served.sum() + r.dropped.sum() == len(arrival)
    assert (r.first_token_time[served] > arrival[served]).all()
    assert (r.finish_time[served] >= r.first_token_time[served]).all()
    assert r.t_end == max(arrival[-1], np.nanmax(r.finish_time))
    assert (r.busy_s <= r.t_end - arrival[0] + 1e-9).all()
    assert r.step_cost.sum() == pytest.approx(r.objective, rel=1e-9)
    logged = np.nansum(r.e2e_latency) + 5.0 * r.dropped.sum() + 1e-4 * r.energy_j.sum()
    assert r.objective == pytest.approx(logged, rel=1e-9)  # Little's law over the whole episode


def test_finish_reward_sums_to_the_same_objective() -> None:
    # crediting each request when it finishes moves cost between steps, never changes the sum
    accrual, _, _ = _mixed_episode(1e-4)
    finish, _, _ = _mixed_episode(1e-4, reward="finish")
    assert finish.objective == pytest.approx(accrual.objective, rel=1e-9)
    assert not np.allclose(finish.step_cost, accrual.step_cost)
    np.testing.assert_array_equal(finish.finish_time, accrual.finish_time)


def test_step_latency_is_littles_law_integral() -> None:
    # without energy, step k's objective is the time requests spend in [a_k, a_{k+1}) plus its drop
    r, arrival, _ = _mixed_episode(0.0)
    served = ~r.dropped
    bounds = np.append(arrival, r.t_end)
    lo, hi = bounds[:-1, None], bounds[1:, None]
    a, f = arrival[served][None, :], r.finish_time[served][None, :]
    overlap = np.clip(np.minimum(f, hi) - np.maximum(a, lo), 0.0, None).sum(axis=1)
    np.testing.assert_allclose(r.step_cost, overlap + 5.0 * r.dropped, rtol=1e-9, atol=1e-9)


def test_md1_waiting_time_matches_pollaczek_khinchine() -> None:
    # one request at a time, constant service D (a 16-token prefill), Poisson arrivals at rho = 0.7
    service = d(16, 0, 0, 136)
    rho, n = 0.7, 100_000  # the estimate's relative error is ~1-2% at this length
    rng = np.random.default_rng(2024)
    arrival = np.cumsum(rng.exponential(service / rho, n))
    node = cont(max_num_seqs=1, queue_capacity=10**9)
    r = simulate([node, node], arrival, np.full(n, 16), np.ones(n, dtype=int), np.zeros(n, dtype=int))
    wait = r.ttft - service
    assert wait.min() == pytest.approx(0.0, abs=1e-12)
    wq = rho * service / (2 * (1 - rho))
    assert wait.mean() == pytest.approx(wq, rel=0.05)
    assert r.busy_s[0] / (r.t_end - arrival[0]) == pytest.approx(rho, rel=0.02)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"prompt": [4, 4]}, "prompt has length 2"),
        ({"actions": [0, 0, 2]}, r"actions\[2\] = 2 is out of range"),
        ({"arrival": [0.0, 1.0, 0.5]}, r"arrival must be non-decreasing: arrival\[2\]"),
        ({"prompt": [4, 0, 4]}, r"prompt must be >= 1: prompt\[1\]"),
        ({"output": [0, 1, 1]}, r"output must be >= 1: output\[0\]"),
        ({"output": [30, 1, 1]}, "kv_blocks of node 0"),
        ({"objective": "goodput"}, "objective must be one of"),
        ({"reward": "end"}, "reward must be one of"),
        ({"end": "cut"}, "t_cut must be a finite time"),
        ({"end": "cut", "t_cut": 0.1}, "t_cut must be a finite time"),
        ({"chunk_ids": [[0], [1], [2]]}, "must be given together"),
    ],
)
def test_input_validation(kwargs: dict, match: str) -> None:
    args = {"arrival": [0.0, 0.1, 0.2], "prompt": [4, 4, 4], "output": [1, 1, 1], "actions": [0, 0, 1]}
    args.update(kwargs)
    nodes = [cont(block_size=4, kv_blocks=8), dyn()]
    with pytest.raises(ValueError, match=match):
        simulate(nodes, **args)


def test_node_validation() -> None:
    with pytest.raises(ValueError, match="scheduler must be one of"):
        RefNode(scheduler="static", latency=LM)
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        cont(max_num_seqs=0)
    with pytest.raises(ValueError, match="latency.token_s must be a scalar"):
        RefNode(scheduler="dynamic", latency=LM._replace(token_s=np.ones(2)))
    with pytest.raises(ValueError, match="power needs idle_w <= static_w <= tdp_w"):
        cont(power=PowerModel(100.0, 50.0, 80.0, 0.0, 0.0, 0.0, 0.0))
    with pytest.raises(ValueError, match="power.token_j must be a finite number >= 0"):
        cont(power=flat()._replace(token_j=-1.0))
    assert math.isinf(cont().sleep_timeout)


# -- prefix cache -----------------------------------------------------------------------------
# Chunks of 8 tokens (2 blocks of 4); prompts of 16 tokens are two chunks, output 1, so each
# request finishes in its single prefill iteration, long before the next arrives.
BS, GRAIN = 4, 8


def _cached(arrival, ids, actions=None, prompt=16, kv_blocks=8, n_nodes=1):
    """A prefix-caching episode of requests whose two chunks have the given ids."""
    e = len(ids)
    prompts = np.broadcast_to(prompt, e)
    nodes = [cont(block_size=BS, kv_blocks=kv_blocks, prefix_caching=True)] * n_nodes
    actions = np.zeros(e, int) if actions is None else actions
    return simulate(
        nodes,
        arrival,
        prompts,
        np.ones(e, int),
        actions,
        chunk_ids=np.asarray(ids),
        id_tokens=np.full(e, 16),
        chunk_tokens=np.full(6, GRAIN),
        grain=GRAIN,
    )


def test_prefix_cache_evicts_least_recently_released() -> None:
    # 8 blocks hold two requests' chunks. A [0,1] and B [2,3] fill the cache as they finish (each
    # releases its last chunk first: LRU order 1, 0, 3, 2). C [4,5] evicts A's (1 then 0). D on A's
    # chain misses and evicts B's; E on C's chain hits both chunks; F on B's chain misses.
    ids = [[0, 1], [2, 3], [4, 5], [0, 1], [4, 5], [2, 3]]
    r = _cached([0.0, 1.0, 2.0, 3.0, 4.0, 5.0], ids)
    assert r.hit_tokens.tolist() == [0, 0, 0, 0, 12, 0]  # E's hit is capped (next test)
    assert r.evicted_blocks.tolist() == [12]  # C, D and F each evicted two chunks of 2 blocks
    assert r.saved_tokens.tolist() == [12]
    full = d(16, 0, 0, 136)
    assert r.ttft.tolist() == [full, full, full, full, d(4, 0, 0, 4 * (12 + 2.5)), full]
    assert r.prefill_tokens.tolist() == [5 * 16 + 4]


def test_prefix_hit_leaves_at_least_one_token_to_compute() -> None:
    # With a prompt of L tokens the hit is capped at block_size * floor((L - 1) / block_size), at
    # block (not chunk) grain; the request still pins every chunk it hit. L = 16: 12 tokens hit, 4
    # prefilled. L = 17: 16 hit, 1 left, which is a decode step over 16 KV tokens. L = 19: 16 hit,
    # 3 prefilled.
    for length, hit, second in [
        (16, 12, d(4, 0, 0, 4 * 14.5)),
        (17, 16, d(0, 1, 16, 0)),
        (19, 16, d(3, 0, 0, 3 * 18.0)),
    ]:
        r = _cached([0.0, 1.0], [[0, 1], [0, 1]], prompt=length)
        assert r.hit_tokens.tolist() == [0, hit]
        assert r.ttft[1] == second


def test_prefix_cache_is_per_node() -> None:
    # A's chunks are cached on node 0 only: the same chain misses on node 1 and hits on node 0
    r = _cached([0.0, 1.0, 2.0], [[0, 1], [0, 1], [0, 1]], actions=[0, 1, 0], n_nodes=2)
    assert r.hit_tokens.tolist() == [0, 0, 12]
    assert r.saved_tokens.tolist() == [12, 0]


def test_running_requests_share_pinned_chunks() -> None:
    # B arrives while A (same chain, long output) still runs: A's chunks are pinned, B hits them
    # and needs no block for them; without the cache B's 4 blocks would not fit beside A's 5
    r = simulate(
        [cont(block_size=BS, kv_blocks=6, prefix_caching=True)],
        [0.0, 0.01],
        [16, 16],
        [6, 1],
        [0, 0],
        chunk_ids=[[0, 1], [0, 1]],
        id_tokens=[16, 16],
        chunk_tokens=[GRAIN, GRAIN],
        grain=GRAIN,
    )
    assert r.hit_tokens.tolist() == [0, 12]
    assert r.total_preemptions == 0
    assert r.finish_time[1] < r.finish_time[0]


def test_chunk_validation() -> None:
    node = cont(block_size=BS, kv_blocks=8, prefix_caching=True)
    base = dict(chunk_ids=[[0, 1]], id_tokens=[16], chunk_tokens=[GRAIN, GRAIN], grain=GRAIN)
    cases = [
        ({"chunk_ids": [[-1, 1]]}, r"chunk_ids\[0\] has a -1 before a chunk id"),
        ({"chunk_ids": [[0, 2]]}, r"chunk_ids must lie in \[-1, 2\)"),
        ({"chunk_ids": [0, 1]}, r"chunk_ids must have shape \[1, B\]"),
        ({"id_tokens": [16, 16]}, r"id_tokens must have shape \[1\]"),
        ({"chunk_tokens": [GRAIN, 4]}, r"chunk_tokens\[1\] = 4, but chunk 1 of request 0 has 8 tokens"),
        ({"grain": 6, "chunk_tokens": [6, 6], "id_tokens": [12]}, r"grain \(6\) must be a multiple"),
    ]
    for change, match in cases:
        with pytest.raises(ValueError, match=match):
            simulate([node], [0.0], [16], [1], [0], **{**base, **change})


# -- dynamic batching with padding -------------------------------------------------------------
def test_dynamic_padding_pads_prompts_and_keeps_finished_rows() -> None:
    # a full batch of P = 10 (O = 1) and P = 4 (O = 3). Padded: 2 rows of 10 prefill, then both
    # rows decode over the padded context (10 + g - 1 each) until the longer output is done.
    # Unpadded: the real prompts, then only the unfinished member decodes over its own context.
    args = ([0.0, 0.0], [10, 4], [1, 3], [0, 0])
    padded = simulate([dyn(max_batch_size=2, padding=True)], *args)
    pre = d(20, 0, 0, 2 * 55)
    assert padded.finish_time.tolist() == [pre, pre + d(0, 2, 20, 0) + d(0, 2, 22, 0)]
    assert padded.prefill_tokens.tolist() == [20]
    unpadded = simulate([dyn(max_batch_size=2, padding=False)], *args)
    pre = d(14, 0, 0, 55 + 10)
    assert unpadded.finish_time.tolist() == [pre, pre + d(0, 1, 4, 0) + d(0, 1, 5, 0)]
    assert unpadded.prefill_tokens.tolist() == [14]


def test_dynamic_padding_one_token_prompts_decode() -> None:
    r = simulate([dyn(max_batch_size=2, padding=True)], [0.0, 0.0], [1, 1], [1, 1], [0, 0])
    assert r.ttft.tolist() == [d(0, 2, 0, 0)] * 2


# -- energy ------------------------------------------------------------------------------------
def test_busy_energy_follows_the_work_and_is_capped() -> None:
    # energy of an iteration = static x duration + per iteration + per token + per KV token + per
    # pair, at most tdp x duration: here the prefill hits the cap, the decode does not
    pw = PowerModel(
        idle_w=100.0, tdp_w=800.0, static_w=300.0, iteration_j=0.5, token_j=0.01, kv_token_j=0.001, pair_j=1.0
    )
    r = simulate([cont(power=pw)], [0.0], [10], [2], [0])
    d1, d2 = d(10, 0, 0, 55), d(0, 1, 10, 0)
    e1 = min(800.0 * d1, 300.0 * d1 + 0.5 + 0.1 + 55.0)
    e2 = min(800.0 * d2, 300.0 * d2 + 0.5 + 0.01 + 0.01)
    assert e1 == 800.0 * d1 and e2 < 800.0 * d2
    assert r.energy_j[0] == pytest.approx(e1 + e2, rel=1e-12)


# -- episode end, rewards, objectives ----------------------------------------------------------
def test_cut_stops_at_the_next_arrival() -> None:
    # one request still decoding at the cut: not logged, its latency accrued up to the cut
    # (accrual) or not charged at all (finish); energy is drawn up to the cut
    args = ([cont()], [0.0], [10], [200], [0])
    accrual = simulate(*args, end="cut", t_cut=0.5, ttft_weight=2.0, energy_weight=1e-3)
    assert np.isnan(accrual.finish_time[0]) and np.isnan(accrual.ttft[0])
    assert accrual.t_end == 0.5
    assert accrual.energy_j[0] == pytest.approx(700.0 * 0.5, rel=1e-12)
    first = d(10, 0, 0, 55)  # the TTFT term accrues until the first token
    assert accrual.step_cost[0] == pytest.approx(0.5 + 2.0 * first + 1e-3 * 350.0, rel=1e-12)
    finish = simulate(*args, end="cut", t_cut=0.5, reward="finish", energy_weight=1e-3)
    assert finish.step_cost[0] == pytest.approx(1e-3 * 350.0, rel=1e-12)
    drained = simulate(*args, ttft_weight=2.0)
    assert drained.objective == pytest.approx(drained.e2e_latency[0] + 2.0 * drained.ttft[0], rel=1e-12)


def test_excess_objective_counts_only_what_an_idle_node_would_not() -> None:
    # alone on an idle node a request costs nothing beyond its service time; a dynamic batcher's
    # window is not part of the service time, so it is charged (to e2e and TTFT)
    # (budget 4: the 9-token prompt prefills 4, 4, then a one-token decode step)
    lone = simulate(
        [cont(max_num_batched_tokens=4)], [0.0], [9], [3], [0], objective="excess", ttft_weight=1.0
    )
    assert lone.objective == 0.0
    assert lone.service_ttft[0] == lone.ttft[0]
    window = simulate([dyn(max_queue_delay=0.05)], [0.0], [10], [3], [0], objective="excess", ttft_weight=1.0)
    assert window.objective == pytest.approx(2 * 0.05, rel=1e-12)
    # with a second node the service time is the faster node's
    two = simulate([cont(speed=2.0), cont()], [0.0], [10], [3], [0], objective="excess")
    assert two.objective == pytest.approx(two.e2e_latency[0] / 2, rel=1e-12)


def test_slo_objective_counts_goodput_and_drops() -> None:
    # three requests on a one-batch node: the first meets a TTFT target the queued ones miss,
    # the third is dropped
    node = dyn(max_batch_size=1, queue_capacity=1)
    r = simulate(
        [node],
        [0.0, 0.0, 0.0],
        [4, 4, 4],
        [1, 1, 1],
        [0, 0, 0],
        objective="slo",
        ttft_slo=1.5 * d(4, 0, 0, 10),
        drop_penalty=7.0,
    )
    assert r.slo_met.tolist() == [True, False, False]
    assert r.goodput == 1
    # all arrive at 0: both finishes and the drop fall in the last step
    assert r.step_cost.tolist() == [0.0, 0.0, -1.0 + 7.0]
