"""BurstBalance: the functional environment (gymnax / Jumanji style).

One step routes one arriving request to one of N nodes; simulated time then advances to the next
arrival while every node runs its scheduler. State and parameters are pytrees, `step_env` is
pure and jittable, and `batched_step` runs many clusters in one jitted call with auto-reset
inside jit (the reset branch is a `lax.cond` taken only when an episode ends).

- Observation: `burstgym.observation` (float32 vector, every field documented there).
- Action: the index of the node that receives the arriving request.
- Reward: `burstgym.reward` (minus the objective accrued in the step).
- Episode: `horizon` arrivals (`episode_length`, or fewer for a staggered first episode). With
  `end="drain"` the last step serves every accepted request, so each request's full latency is
  in the episode and the end is a termination; with `end="cut"` the episode stops at the next
  arrival, requests still in flight are not charged, and the end is a truncation.

Slot widths: a node's slot table has room for `EnvConfig.slots` requests (all it can ever hold),
but it holds far fewer at most steps, and the cost of a step grows with the table's width. Occupied
slots sit at the front of each table at the start of a step (`scheduler.compact` closes the holes
at the end of every step), and a step adds at most one request, so a step runs on the first `w`
slots of every table, for the narrowest `w` in `slot_widths(cfg)` that holds every node's requests
and the arriving one, and the slots beyond `w` (all free) are left as they were. The width is
chosen on the state, one branch compiled per width, each branch a `lax.cond` that passes the state
through unless its width is chosen (not one `lax.switch`: see `_at_width`). A batch of clusters runs
at the width its fullest cluster needs, the choice outside the vmap (a `cond` on a batched
predicate would run every branch).

Chunk widths: with prefix caching, a slot's chunks are a row of `B` entries, `B` the most chunks any
request of the stream has (a trace's longest prompt), while most requests have far fewer (the
Mooncake trace: median 23 of 374). A step on the narrowest slot tables also runs on the first `c`
chunks of every request, for the narrowest `c` in `chunk_widths(cfg, B)` that holds every chunk of
the requests in the slots, the arriving one and the next (whose view the step returns); the chunks
beyond are all absent (-1), so nothing depends on `c` but the cost. Each chunk width is one more
branch (compiled once), on the narrowest slot width only.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from burstgym import cluster, prefix_cache, scheduler
from burstgym.cluster import Accrual, Cluster
from burstgym.latency import step_time
from burstgym.metrics import episode_metrics
from burstgym.observation import LOAD_SIGNALS, RouterView, action_mask, load_signals, observe, router_view
from burstgym.reward import finished_cost, step_cost
from burstgym.types import (
    DONE,
    EMPTY,
    ERROR_CACHE_FULL,
    ERROR_RUNAWAY,
    ERROR_STAMP_OVERFLOW,
    IDLE,
    NO_REQUEST,
    EnvConfig,
    EnvParams,
    NodeState,
    RequestLog,
    Service,
    Slots,
    State,
)
from burstgym.workload import Requests

# Release stamps stay below this, so int32 never wraps (a longer episode raises instead).
_STAMP_LIMIT = 2**31 - 2**24


class _Step(NamedTuple):
    """A step between routing and its bookkeeping."""

    state: State
    acc: Accrual
    dropped: jax.Array  # [] bool
    service: jax.Array  # [] idle-node cost of the routed request if accepted (excess objective)
    until: jax.Array  # [] seconds from this arrival to the next (0 on a draining last step)
    last: jax.Array  # [] bool


def service_times(requests: Requests, params: EnvParams, cfg: EnvConfig) -> Service:
    """Each request's TTFT and e2e alone on an idle node with an empty cache (the fastest node),
    front-end latency included.

    Continuous batching prefills the prompt in chunks of the token budget; dynamic batching
    prefills it in one iteration. A one-token last chunk (or prompt) is a decode step, as the
    schedulers classify it. Then O - 1 decode iterations read P, P + 1, ... KV tokens;
    a decode step is affine in its KV tokens at batch 1 (burstgym.latency), so their sum is
    (O - 1) d(P) + (d(P + 1) - d(P)) (O - 1)(O - 2) / 2.
    """
    p = params.nodes
    fdt = requests.arrival.dtype
    prompt = requests.prompt.astype(fdt)
    steps = (requests.output - 1).astype(fdt)

    def one(lat, speed, budget):
        if cfg.scheduler == "continuous":
            chunk = budget.astype(fdt)

            def cond(c):
                return (c[0] < prompt).any()

            def body(c):
                done, t = c
                n = jnp.clip(prompt - done, 0.0, chunk)
                pairs = n * (done + (n + 1.0) / 2.0)
                one = (n == 1.0) & (done == prompt - 1.0)
                d = jnp.where(one, step_time(lat, 0.0, 1.0, done, 0.0), step_time(lat, n, 0.0, 0.0, pairs))
                t = t + jnp.where(n > 0, speed * d, 0.0)
                return done + n, t

            _, ttft = jax.lax.while_loop(cond, body, (jnp.zeros_like(prompt), jnp.zeros_like(prompt)))
        else:
            one = prompt <= 1.0
            pf = jnp.where(one, 0.0, prompt)
            ttft = speed * step_time(lat, pf, jnp.where(one, 1.0, 0.0), 0.0, pf * (pf + 1.0) / 2.0)
        d0 = speed * step_time(lat, 0.0, 1.0, prompt, 0.0)
        slope = speed * step_time(lat, 0.0, 1.0, prompt + 1.0, 0.0) - d0
        ttft = ttft + lat.frontend_s  # the client gets the first token after the front end
        return ttft, ttft + steps * d0 + slope * steps * (steps - 1.0) / 2.0

    ttft, e2e = jax.vmap(one)(p.latency, p.speed, p.max_num_batched_tokens)
    return Service(ttft.min(axis=0), e2e.min(axis=0))


def slot_widths(cfg: EnvConfig) -> tuple[int, ...]:
    """The table widths a step can run at, narrowest first: `cfg.slot_widths` below `cfg.slots`, then it."""
    return tuple(sorted({w for w in cfg.slot_widths if 0 < w < cfg.slots})) + (cfg.slots,)


def chunk_widths(cfg: EnvConfig, chunks: int) -> tuple[int, ...]:
    """The chunk widths a step can run at on the narrowest slot tables, narrowest first:
    `cfg.chunk_widths` below `chunks` (the stream's B), then B."""
    return tuple(sorted({w for w in cfg.chunk_widths if 0 < w < chunks})) + (chunks,)


def needed_chunks(state: State, chunk_tokens: int) -> jax.Array:
    """[] chunks per request a step needs: the most any request in a slot, the arriving request or
    the next one has (over every leading axis, as `needed_width`)."""
    tokens = state.requests.id_tokens  # [..., R]
    rows = tokens.shape[-1]
    lead = tokens.shape[:-1]
    slots = state.slots
    k = jnp.asarray(state.step)[..., None]
    rows_read = jnp.concatenate([slots.req.reshape(lead + (-1,)), k, k + 1], axis=-1)
    read = jnp.concatenate(
        [(slots.status != EMPTY).reshape(lead + (-1,)), jnp.ones(lead + (2,), bool)], axis=-1
    )
    longest = jnp.where(read, jnp.take_along_axis(tokens, jnp.clip(rows_read, 0, rows - 1), axis=-1), 0).max()
    return prefix_cache.ceil_div(longest, chunk_tokens)  # only the rows read, not every request's


def needed_width(slots: Slots) -> jax.Array:
    """[] slots a step needs: up to the last non-empty slot of the fullest table (over every leading
    axis, so a batch needs what its fullest cluster needs), plus one for the arriving request."""
    pos = jnp.arange(slots.status.shape[-1], dtype=jnp.int32)
    return jnp.max(jnp.where(slots.status != EMPTY, pos, -1)) + 2


def _with_slots(state: State, slots: Slots) -> State:
    return state._replace(slots=slots)


def _narrow(slots: Slots, width: int) -> Slots:
    return jax.tree.map(lambda x: x[..., :width], slots)


def _widen(full: Slots, narrow: Slots) -> Slots:
    """`full` with its first slots replaced by `narrow` (the rest are free and stay as they were)."""
    return jax.tree.map(lambda f, n: jax.lax.dynamic_update_slice_in_dim(f, n, 0, f.ndim - 1), full, narrow)


class BurstBalance:
    """The functional environment: pure functions of (state, action, params) for one cluster."""

    def __init__(self, cfg: EnvConfig):
        if cfg.prefix_caching and cfg.cache_entries < 1:
            raise ValueError(
                f"EnvConfig.cache_entries must be >= 1 with prefix caching, got {cfg.cache_entries} "
                "(scenarios.make sizes it from the nodes' KV blocks)"
            )
        self.cfg = cfg
        self.widths = slot_widths(cfg)

    # ------------------------------------------------------------------------------------- reset

    def reset(
        self, key: jax.Array, params: EnvParams, horizon: jax.Array | None = None
    ) -> tuple[jax.Array, State]:
        """Draw a request stream and return the first observation and the initial state.

        `horizon` (default `episode_length`) routes fewer requests in this episode: used to stagger
        the first episodes of a batch of environments.
        """
        cfg = self.cfg
        key, sub = jax.random.split(key)
        req = cfg.workload.sample(sub, cfg.episode_length + 1)
        n, s, e = cfg.n_nodes, cfg.slots, cfg.episode_length
        fdt = req.arrival.dtype
        zf = jnp.zeros(n, fdt)
        zi = jnp.zeros(n, jnp.int32)
        nodes = NodeState(
            phase=jnp.full(n, IDLE, jnp.int32),
            iter_start=zf,
            iter_end=zf,
            repeat=jnp.ones(n, jnp.int32),
            run_d0=zf,
            run_growth=zf,
            busy_w=zf,
            wake_end=zf,
            idle_since=zf,
            last_time=zf,
            energy_j=zf,
            busy_s=zf,
            routed=zi,
            batch_rows=zi,
            batch_prompt=zi,
            batch_gen=zi,
            prefill_tokens=zi,
            saved_tokens=zi,
            hit_tokens=zi,
            admitted_prompt=zi,
        )
        # A chunk's tokens follow from its place in the sequence; the per-id list is not kept.
        req = req._replace(chunk_tokens=req.chunk_tokens[:0])
        n_positions = prefix_cache.positions(cfg) if cfg.prefix_caching else 1
        cache = jax.vmap(lambda _: prefix_cache.empty_cache(n_positions))(jnp.arange(n))
        log = RequestLog(
            node=jnp.full(e, -1, jnp.int32),
            dropped=jnp.zeros(e, bool),
            ttft=jnp.full(e, jnp.nan, fdt),
            e2e=jnp.full(e, jnp.nan, fdt),
            preemptions=jnp.zeros(e, jnp.int32),
            hit_tokens=jnp.zeros(e, jnp.int32),
        )
        horizon = jnp.int32(e) if horizon is None else jnp.clip(jnp.asarray(horizon, jnp.int32), 1, e)
        state = State(
            key=jax.random.key_data(key),
            requests=req,
            service=service_times(req, params, cfg),
            step=jnp.int32(0),
            horizon=horizon,
            clock=jnp.zeros((), fdt),
            t_end=jnp.asarray(jnp.nan, fdt),
            rate_estimate=params.arrival_rate.astype(fdt),
            seen=jnp.zeros((n, len(LOAD_SIGNALS)), fdt),
            next_refresh=params.signal_interval.astype(fdt),
            slots=scheduler.empty_slots(n, s, fdt),
            nodes=nodes,
            cache=cache,
            log=log,
            error=jnp.int32(0),
        )
        geo = cluster.geometry(state.slots, req, params, cfg)
        state = state._replace(seen=load_signals(state, geo, params, cfg))
        return self._observe(state, params), state

    # -------------------------------------------------------------------------------------- step

    def _route_advance(self, state: State, action: jax.Array, params: EnvParams) -> _Step:
        """Route request `state.step` and advance to the next arrival, or on a draining last step
        serve every accepted request and let idle nodes fall asleep up to the end of the episode
        (docs/semantics.md, "End of episode")."""
        cfg = self.cfg
        req = state.requests
        k = state.step
        node = jnp.clip(action, 0, cfg.n_nodes - 1).astype(jnp.int32)
        r = cluster.route(state.slots, state.nodes, k, req.prompt[k], req.output[k], node, params)
        last = k >= state.horizon - 1
        gap = req.arrival[k + 1] - req.arrival[k]
        drain = last & (cfg.end == "drain")
        zero = jnp.zeros(cfg.n_nodes, gap.dtype)
        # the front-end latency adds to an accepted request's TTFT and e2e: charged when it is routed,
        # through a select XLA fuses rather than a scatter
        lump = jnp.where(r.joined, params.nodes.latency.frontend_s.astype(zero.dtype), zero)
        acc = Accrual(lump, lump, zero)
        geo = cluster.geometry(r.slots, req, params, cfg)
        c, acc, until, runaway = cluster.advance(
            Cluster(r.slots, r.nodes, state.cache), acc, gap, drain, geo, params, cfg
        )
        everyone = jnp.ones(cfg.n_nodes, bool)
        nodes, acc = cluster.accrue(c.slots, c.nodes, acc, jnp.full(cfg.n_nodes, until), everyone, params)
        svc = state.service.e2e[k] + params.ttft_weight * state.service.ttft[k]
        log = state.log._replace(
            node=state.log.node.at[k].set(node), dropped=state.log.dropped.at[k].set(r.dropped)
        )
        error = state.error | r.error | jnp.where(runaway, ERROR_RUNAWAY, 0)
        new = state._replace(slots=c.slots, nodes=nodes, cache=c.cache, log=log, error=error)
        return _Step(new, acc, r.dropped, jnp.where(r.dropped, 0.0, svc), until, last)

    def _close(self, st: _Step, params: EnvParams) -> tuple[jax.Array, State, jax.Array, jax.Array, dict]:
        """Log the finished requests, compute the reward, move the clock to the next arrival."""
        cfg = self.cfg
        state, last, until = st.state, st.last, st.until
        slots = state.slots
        done_cost = finished_cost(slots, state.service, cfg, params)
        cost = step_cost(st.acc, done_cost, st.service, st.dropped, cfg, params)
        done = slots.status == DONE
        target = jnp.where(done, slots.req, NO_REQUEST)
        log = state.log._replace(
            ttft=state.log.ttft.at[target].set(slots.ttft, mode="drop"),
            e2e=state.log.e2e.at[target].set(slots.e2e, mode="drop"),
            preemptions=state.log.preemptions.at[target].set(slots.preempted, mode="drop"),
            hit_tokens=state.log.hit_tokens.at[target].set(slots.hit, mode="drop"),
        )
        slots = slots._replace(status=jnp.where(done, EMPTY, slots.status))
        slots = jax.vmap(scheduler.compact)(slots)
        # The clock's origin moves to the next arrival.
        shift = jnp.where(last, 0.0, until)
        n = state.nodes
        nodes = n._replace(
            iter_start=n.iter_start - shift,
            iter_end=n.iter_end - shift,
            wake_end=n.wake_end - shift,
            idle_since=n.idle_since - shift,
            last_time=n.last_time - shift,
        )
        slots = slots._replace(arrival=slots.arrival - shift)
        clock = state.clock + until
        k = state.step
        gap = state.requests.arrival[k + 1] - state.requests.arrival[k]
        w = params.rate_window
        rate = state.rate_estimate * jnp.exp(-gap / w) + 1.0 / w
        cache = state.cache
        error = state.error | jnp.where(cache.table.counter.max() > _STAMP_LIMIT, ERROR_STAMP_OVERFLOW, 0)
        error = error | jnp.where(cache.full.any(), ERROR_CACHE_FULL, 0)
        new = state._replace(
            step=k + 1,
            clock=clock,
            t_end=jnp.where(last, clock, jnp.nan),
            rate_estimate=jnp.where(last, state.rate_estimate, rate),
            slots=slots,
            nodes=nodes,
            log=log,
            error=error,
        )
        geo = cluster.geometry(new.slots, new.requests, params, cfg)
        interval = params.signal_interval
        refresh = clock >= state.next_refresh
        seen = jnp.where(refresh, load_signals(new, geo, params, cfg), state.seen)
        nxt = jnp.where(
            interval > 0, (jnp.floor(clock / jnp.where(interval > 0, interval, 1.0)) + 1.0) * interval, 0.0
        )
        new = new._replace(seen=seen, next_refresh=jnp.where(refresh, nxt, state.next_refresh))
        view = router_view(new, params, cfg)
        info = {"dropped": st.dropped, "action_mask": action_mask(view), "error": new.error}
        return observe(view, params, cfg), new, -cost / params.reward_scale, last, info

    def _tidy(self, state: State) -> State:
        """`state` (one cluster or a batch) with its prefix-cache tables rebuilt if they need it."""
        if not self.cfg.prefix_caching:
            return state
        return state._replace(cache=prefix_cache.tidy(state.cache))

    def _at_width(self, state: State, step) -> tuple:
        """`step(state)` -> (obs, state, reward, done, info) run on the narrowest slot tables that
        hold `state` (one cluster or a batch; see "Slot widths" above) and, on the narrowest
        slot tables, on the fewest chunks per request that hold it ("Chunk widths")."""

        def branch(width: int, chunks: int | None):
            def run(st: State):
                narrow = _with_slots(st, _narrow(st.slots, width))
                if chunks is not None:
                    ids = st.requests.chunk_ids[..., :chunks]
                    narrow = narrow._replace(requests=st.requests._replace(chunk_ids=ids))
                out = step(narrow)
                new = _with_slots(out[1], _widen(st.slots, out[1].slots))._replace(requests=st.requests)
                return (out[0], new, *out[2:])

            return run

        b = state.requests.chunk_ids.shape[-1]
        narrow_chunks = chunk_widths(self.cfg, b)[:-1] if self.cfg.prefix_caching else ()
        branches = [branch(self.widths[0], c) for c in narrow_chunks]
        branches += [branch(w, None) for w in self.widths]
        if len(branches) == 1:
            return branches[0](state)
        index = jnp.searchsorted(jnp.asarray(self.widths, jnp.int32), needed_width(state.slots))
        if narrow_chunks:
            by_chunks = jnp.searchsorted(
                jnp.asarray(narrow_chunks, jnp.int32), needed_chunks(state, self.cfg.chunk_tokens)
            )
            index = jnp.where(index == 0, by_chunks, index + len(narrow_chunks))
        # One `lax.cond` per branch, each passing its input through unless its index is chosen,
        # rather than one `lax.switch`: the branches of a switch get the same state buffers, XLA
        # lets one branch update them in place and copies them for the others, in a program that
        # scans the step inside its event loops at every pass (the prefix cache's [N, H] tables;
        # docs/performance.md, "Compiling"). A cond whose other branch passes the state through
        # updates them in place.
        # The chain starts from zeros shaped as the outputs. The first branch is a jitted function
        # so that its `lax.cond` reuses the trace that gave those shapes instead of tracing the
        # step once more (docs/performance.md, "Compiling").
        branches[0] = jax.jit(branches[0])
        shapes = branches[0].eval_shape(state)
        obs, _, *rest = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)
        out = (obs, state, *rest)
        for k, run in enumerate(branches):
            out = jax.lax.cond(index == k, lambda o, run=run: run(o[1]), lambda o: o, out)
        return out

    def step_env(
        self, state: State, action: jax.Array, params: EnvParams
    ) -> tuple[jax.Array, State, jax.Array, jax.Array, dict[str, jax.Array]]:
        """Route request `state.step` to node `action` and advance to the next arrival.

        Returns (observation, state, reward, done, info). Out-of-range actions are the caller's
        to refuse (the Gymnasium faces do); here they are clipped so jit stays total. Stepping a
        finished episode is the caller's error to refuse too (the faces raise). To step many
        clusters, use `batched_step_env` rather than a vmap of this (see "Slot widths").
        """

        def step(state: State):
            return self._close(self._route_advance(state, action, params), params)

        return self._at_width(self._tidy(state), step)

    def view(self, state: State, params: EnvParams) -> RouterView:
        """What a router sees of the request `state.step` (`burstgym.observation.RouterView`)."""
        return router_view(state, params, self.cfg)

    def _observe(self, state: State, params: EnvParams) -> jax.Array:
        return observe(self.view(state, params), params, self.cfg)

    def action_mask(self, state: State, params: EnvParams) -> jax.Array:
        """[N] bool: nodes that would accept the next request; all True when every node would drop."""
        return action_mask(self.view(state, params))

    def metrics(self, state: State, params: EnvParams) -> dict[str, jax.Array]:
        """Episode metrics of a finished episode (see `burstgym.metrics`)."""
        return episode_metrics(
            state.requests, state.service, state.log, state.nodes, state.horizon, state.t_end, params
        )

    def step(
        self, state: State, action: jax.Array, params: EnvParams
    ) -> tuple[jax.Array, State, jax.Array, jax.Array, dict[str, Any]]:
        """`step_env` with auto-reset: when the episode ends the returned state and observation
        are those of a new episode (drawn with `state.key`); the info carries `final_obs` and
        the finished episode's `metrics`."""
        obs, new, reward, done, info = self.step_env(state, action, params)

        def restart(_):
            o, s = self.reset(jax.random.wrap_key_data(new.key), params)
            return o, s, self.metrics(new, params)

        def carry_on(_):
            return obs, new, jax.tree.map(jnp.zeros_like, jax.eval_shape(lambda: self.metrics(new, params)))

        obs2, state2, metrics = jax.lax.cond(done, restart, carry_on, None)
        mask = jnp.where(done, self.action_mask(state2, params), info["action_mask"])
        info = {**info, "action_mask": mask, "final_obs": obs, "metrics": metrics}
        return obs2, state2, reward, done, info

    # ---------------------------------------------------------------------------------- batches

    def batched_reset(
        self, keys: jax.Array, params: EnvParams, horizons: jax.Array | None = None
    ) -> tuple[jax.Array, State]:
        """Reset a batch of clusters, one key each (shared parameters)."""
        if horizons is None:
            return jax.vmap(self.reset, in_axes=(0, None))(keys, params)
        return jax.vmap(self.reset, in_axes=(0, None, 0))(keys, params, horizons)

    def batched_step_env(
        self, states: State, actions: jax.Array, params: EnvParams, per_cluster: bool = False
    ) -> tuple[jax.Array, State, jax.Array, jax.Array, dict[str, Any]]:
        """`step_env` over a batch of clusters, without auto-reset.

        `per_cluster`: `params` has a leading cluster axis (`burstgym.rollout.per_cluster`) rather
        than being shared. The batch runs at the slot width its fullest cluster needs.
        """
        axis = 0 if per_cluster else None

        def step(states: State):
            st = jax.vmap(self._route_advance, in_axes=(0, 0, axis))(states, actions, params)
            return jax.vmap(self._close, in_axes=(0, axis))(st, params)

        return self._at_width(self._tidy(states), step)

    def batched_step(
        self, states: State, actions: jax.Array, params: EnvParams
    ) -> tuple[jax.Array, State, jax.Array, jax.Array, dict[str, Any]]:
        """Step a batch of clusters; clusters whose episode ended are reset inside the same call.

        The reset (and the finished episodes' metrics) sit behind one `lax.cond` on "any episode
        ended", so ordinary steps pay nothing for them.
        """
        obs, new, reward, done, info = self.batched_step_env(states, actions, params)
        metric_shape = jax.eval_shape(lambda s: jax.vmap(self.metrics, in_axes=(0, None))(s, params), new)

        def restart(_):
            metrics = jax.vmap(self.metrics, in_axes=(0, None))(new, params)
            o, s = self.batched_reset(jax.vmap(jax.random.wrap_key_data)(new.key), params)
            s = cluster.tree_where(done, s, new)
            o = jnp.where(done[:, None], o, obs)
            mask = jax.vmap(self.action_mask, in_axes=(0, None))(s, params)
            return o, s, metrics, mask

        def carry_on(_):
            zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), metric_shape)
            return obs, new, zeros, info["action_mask"]

        obs2, states2, metrics, mask = jax.lax.cond(done.any(), restart, carry_on, None)
        info = {**info, "action_mask": mask, "final_obs": obs, "metrics": metrics}
        return obs2, states2, reward, done, info
