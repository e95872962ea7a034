"""Routing decisions per second: the JAX rollout engine (whole episodes in one jitted scan, JAX
routers) at several cluster counts, the vector environment at several batch sizes, the single
Gymnasium environment, and the plain-Python reference simulator, measured in one run.

Each configuration runs whole episodes (the final, draining step included) and reports decisions
(routing steps) per second of wall time, compile time excluded: the environments and the
reference are driven with round-robin actions after a warm-up episode that pays the JIT compile;
the JAX rollout (`burstgym.rollout`, routed by `agents.routers`) is compiled ahead of time,
and its compile time is reported apart. A JAX size whose run the previous size predicts to take
longer than `--budget-s` is skipped and reported as not measured.

    python benchmarks/throughput.py                      # JAX 1, 256, 4096 clusters; env 1, 256, 4096
    python benchmarks/throughput.py --scenario prefix --jax-clusters 1 256 --batch 1 32 --json out.json
    python benchmarks/throughput.py --gpu-sizes          # adds 65,536 clusters (default on GPUs only)
    python benchmarks/throughput.py --no-baselines --batch --jax-clusters 256   # the JAX rows only
    python benchmarks/throughput.py --episode-length 512 --kernels   # XLA kernels per decision
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from agents.cli import parse_settings  # noqa: E402
from agents.routers import ROUTERS, make_rule  # noqa: E402
from burstgym import reference, scenarios  # noqa: E402
from burstgym.gym_env import BurstBalanceEnv, BurstBalanceVectorEnv  # noqa: E402
from burstgym.latency.cliargs import int_at_least, positive_float, refusals  # noqa: E402
from burstgym.rollout import rollout  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the scripts' shared module
import xla_trace  # noqa: E402

GPU_SIZES = (65_536,)


class Clock:
    """Wall and process CPU seconds since start (CPU: every thread of this process), so a
    benchmark on a loaded machine also reports the work it did."""

    def __init__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def read(self) -> tuple[float, float]:
        return time.perf_counter() - self.wall, time.process_time() - self.cpu


def vector_rate(n_envs: int, scenario: str, settings: dict, episodes: int) -> tuple[int, float, float]:
    """(decisions, wall s, CPU s) of `BurstBalanceVectorEnv(n_envs)` over whole episodes."""
    env = BurstBalanceVectorEnv(n_envs, scenario, **settings)
    length = env.cfg.episode_length
    n_nodes = env.cfg.n_nodes
    env.reset(seed=0)
    base = np.arange(n_envs)
    for k in range(length):  # warm-up episode: compiles step and auto-reset
        env.step((base + k) % n_nodes)
    clock = Clock()
    for k in range(episodes * length):
        env.step((base + k) % n_nodes)
    return n_envs * episodes * length, *clock.read()


def single_rate(scenario: str, settings: dict, episodes: int) -> tuple[int, float, float]:
    """(decisions, wall s, CPU s) of the single Gymnasium environment over whole episodes."""
    env = BurstBalanceEnv(scenario, **settings)
    n_nodes = env.cfg.n_nodes
    steps = 0
    clock = None
    for ep in range(episodes + 1):
        if ep == 1:
            clock = Clock()
        env.reset(seed=ep)
        done, k = False, 0
        while not done:
            _, _, terminated, truncated, _ = env.step(k % n_nodes)
            done = terminated or truncated
            k += 1
        steps += k if ep else 0
    return steps, *clock.read()


def reference_rate(scenario: str, settings: dict, episodes: int) -> tuple[int, float, float]:
    """(decisions, wall s, CPU s) of the reference simulator on the same streams, round-robin routed."""
    env = BurstBalanceEnv(scenario, **settings)
    nodes = reference.nodes_from_params(env.cfg, env.params)
    total, wall, cpu = 0, 0.0, 0.0
    for ep in range(episodes):
        _, state = env.core.reset(jax.random.key(ep), env.params)
        req = jax.tree.map(np.asarray, state.requests)
        e = env.cfg.episode_length
        actions = np.arange(e) % len(nodes)
        clock = Clock()
        reference.simulate(
            nodes,
            req.arrival[:e],
            req.prompt[:e],
            req.output[:e],
            actions,
            chunk_ids=req.chunk_ids[:e],
            id_tokens=req.id_tokens[:e],
            grain=env.cfg.chunk_tokens,
        )
        w, c = clock.read()
        wall, cpu, total = wall + w, cpu + c, total + e
    return total, wall, cpu


def jax_rate(
    clusters: int, router: str, scenario: str, settings: dict, chunk, min_seconds: float = 1.0
) -> tuple[int, float, float, float, float]:
    """(decisions, wall s, CPU s, compile s, bytes per cluster) of the JAX rollout of `clusters`
    episodes routed by the JAX `router`: a first call compiles (ahead of time, reported apart) and
    runs once untimed; timed calls on fresh seeds follow until `min_seconds` have passed. Bytes
    per cluster are the compiled episode's need (XLA's memory analysis: arguments and outputs of
    every cluster of the call, temporaries of the group vmapped at once) over the clusters."""
    cfg, params = scenarios.make(scenario, **settings)
    routers = [make_rule(router)]
    first = rollout(cfg, params, routers, list(range(clusters)), chunk=chunk)
    compile_s, per_cluster = first.compile_s, first.memory_bytes / clusters
    wall, cpu, runs = 0.0, 0.0, 0
    while runs < 20 and (runs == 0 or wall < min_seconds):
        seeds = list(range((runs + 1) * clusters, (runs + 2) * clusters))
        clock = Clock()
        batch = rollout(cfg, params, routers, seeds, chunk=chunk)
        w, c = clock.read()
        assert batch.compile_s == 0.0
        wall, cpu, runs = wall + w, cpu + c, runs + 1
    return clusters * cfg.episode_length * runs, wall, cpu, compile_s, per_cluster


def profile_step(
    scenario: str, settings: dict, router: str = "least-tokens", reps: int = 5
) -> list[tuple[str, float]]:
    """CPU microseconds per routing step of each part of a step, one cluster (the CPU engine's
    layout): the states of one episode are recorded, then each part is jitted alone and mapped
    over them (best of `reps`); every output is reduced to a checksum so nothing is elided. The
    parts run on the slot tables cut to the narrowest width (`burstgym.env`, "Slot widths"), over
    the steps that width holds (the first row says how many); the whole step runs on every step."""
    from burstgym import cluster
    from burstgym import prefix_cache as pc
    from burstgym.cluster import Accrual, Cluster
    from burstgym.env import BurstBalance, needed_width
    from burstgym.observation import action_mask

    cfg, params = scenarios.make(scenario, **settings)
    core, jr, e, n = BurstBalance(cfg), make_rule(router), cfg.episode_length, cfg.n_nodes
    _, s0 = jax.jit(core.reset)(jax.random.key(0), params)

    def decide(s):
        v = core.view(s, params)
        return jr.act(jr.init(n), v, action_mask(v))[0]

    def episode(s):
        def body(s, _):
            a = decide(s)
            return core.step_env(s, a, params)[1], (s, a)

        return jax.lax.scan(body, s, None, length=e)[1]

    states, actions = jax.block_until_ready(jax.jit(episode)(s0))  # each step's state and action
    whole = states, actions
    width = core.widths[0]
    fits = np.flatnonzero(np.asarray(jax.vmap(needed_width)(states.slots)) <= width)
    states, actions = jax.tree.map(lambda x: x[fits], (states, actions))
    states = states._replace(slots=jax.tree.map(lambda x: x[..., :width], states.slots))

    def checksum(tree):
        return sum(jnp.sum(x.astype(jnp.float32)) for x in jax.tree.leaves(tree) if x.dtype != jnp.bool_)

    def per_step(f, data=None) -> float:
        st, ac = (states, actions) if data is None else data
        g = jax.jit(lambda st, a: jax.lax.map(lambda x: checksum(f(*x)), (st, a)).sum())
        jax.block_until_ready(g(st, ac))
        best = np.inf
        for _ in range(reps):
            clock = Clock()
            jax.block_until_ready(g(st, ac))
            best = min(best, clock.read()[1])
        return best / len(ac) * 1e6

    def routed(s, a):
        k = s.step
        r = cluster.route(s.slots, s.nodes, k, s.requests.prompt[k], s.requests.output[k], a, params)
        return r, s.requests.arrival[k + 1] - s.requests.arrival[k]

    def loop(s, a, passes):  # the event loop of cluster.advance, counted, or `passes` passes of it
        r, until = routed(s, a)
        geo = cluster.geometry(r.slots, s.requests, params, cfg)
        z = jnp.zeros(n)

        def due(k):
            tau = cluster.next_event(k.slots, k.nodes, params, cfg)
            return tau, tau <= until

        def body(c):
            k, acc, tau, act, i = c
            k, acc = cluster._handle_events(k, acc, tau, act, until, geo, params, cfg)
            return (k, acc, *due(k), i + 1)

        at = jax.vmap(pc.locate)(s.cache, geo.chunks.ids) if geo is not None else None
        k0 = Cluster(r.slots, r.nodes, s.cache, at)
        c0 = (k0, Accrual(z, z, z), *due(k0), jnp.int32(0))
        if passes is None:
            return jax.lax.while_loop(lambda c: c[3].any(), body, c0)[4]
        return body(c0)[:2]

    count = jax.jit(lambda st, a: jax.lax.map(lambda x: loop(*x, None), (st, a)))
    passes = np.asarray(count(states, actions))
    every = [
        (
            "whole step: view + router + step_env (every step)",
            lambda s, a: core.step_env(s, decide(s), params)[1],
        ),
        ("step_env (every step, at the width each needs)", lambda s, a: core.step_env(s, a, params)[1]),
    ]
    narrow = [
        (
            f"  at width {width}: route, event loop, accrual (_route_advance)",
            lambda s, a: core._route_advance(s, a, params),
        ),
        ("    route (admission to the slot table)", lambda s, a: routed(s, a)[0]),
        (
            "    route + prefix geometry of the slots",
            lambda s, a: cluster.geometry(routed(s, a)[0].slots, s.requests, params, cfg),
        ),
        ("    route + geometry + one event-loop pass", lambda s, a: loop(s, a, 1)),
        ("router view (cache hits, signals)", lambda s, a: core.view(s, params)),
        (f"view + {router} decision", lambda s, a: decide(s)),
    ]
    rows = [
        (f"steps the narrowest width ({width} slots) holds, of {e}", float(len(fits))),
        (f"event-loop passes per step at that width (mean; max {passes.max()})", float(passes.mean())),
    ]
    rows += [(name, per_step(f, whole)) for name, f in every]
    return rows + [(name, per_step(f)) for name, f in narrow]


def instruction_sources(hlo: str) -> dict[str, tuple[str, str, str]]:
    """Each instruction of a compiled program's HLO text: (opcode, shape, the innermost line of
    burstgym/ or agents/ that made it, from the program's stack-frame tables; "?" if none)."""
    import re

    tables: dict[str, dict[int, str]] = {}
    section = None
    found = {}
    for line in hlo.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = line
            tables[section] = {}
            continue
        row = re.match(r"^(\d+) (.*)$", line)
        if section and row:
            tables[section][int(row.group(1))] = row.group(2)
            continue
        m = re.match(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([a-z][\w\-]*)\(", line)
        if m:
            frame = re.search(r"stack_frame_id=(\d+)", line)
            found[m.group(1)] = (m.group(3), m.group(2), int(frame.group(1)) if frame else 0)

    def field(entry: str, name: str) -> int:
        return int(re.search(rf"{name}=(\d+)", entry).group(1))

    def where(frame: int) -> str:
        seen = set()
        while frame in tables.get("StackFrames", {}) and frame not in seen:
            seen.add(frame)
            entry = tables["StackFrames"][frame]
            loc = tables["FileLocations"][field(entry, "file_location_id")]
            path = tables["FileNames"][field(loc, "file_name_id")].strip('"')
            parts = path.replace("\\", "/").split("/")
            if "burstgym" in parts[:-1] or "agents" in parts[:-1]:
                function = tables["FunctionNames"][field(loc, "function_name_id")].strip('"')
                package = "burstgym" if "burstgym" in parts[:-1] else "agents"
                relative = "/".join(parts[len(parts) - parts[::-1].index(package) - 1 :])
                return f"{relative}:{field(loc, 'line')} {function.split('.')[-1]}"
            frame = field(entry, "parent_frame_id")
        return "?"

    return {name: (op, shape, where(frame)) for name, (op, shape, frame) in found.items()}


def kernels_per_decision(
    scenario: str, settings: dict, router: str = "round-robin"
) -> tuple[float, list, list]:
    """XLA kernels (fusions, copies, scatters, reduce-windows...) the compiled episode runs per
    routing decision: two clusters in one thread, traced by `jax.profiler`, each trace event named
    after an instruction of the compiled program counted once. Returns (kernels per decision, the
    ten most run kinds with their count per decision, the ten kernels with the most traced time
    per decision, each as (microseconds, runs, instruction, shape, source line)). The traced times
    include the profiler's own cost per kernel, so they rank kernels rather than time a step; the
    source line is the innermost one of burstgym/ or agents/ that made the instruction."""
    import collections

    from burstgym import rollout as engine

    cfg, params = scenarios.make(scenario, **settings)
    rule = [make_rule(router)]
    engine.clear_compiled()
    rollout(cfg, params, rule, [0, 1], threads=1)  # compiles
    sources = {}
    for compiled in engine.compiled_episodes():
        sources.update(instruction_sources(compiled.as_text()))
    done, events = xla_trace.traced(lambda: rollout(cfg, params, rule, [2, 3], threads=1))
    runs = [e for e in events if e["name"] in sources]  # the episode's kernels, not the reset's
    kinds = collections.Counter(xla_trace.kind(e["name"]) for e in runs)
    leaves = [
        e for e in xla_trace.leaves(runs) if sources[e["name"]][0] not in ("while", "conditional", "call")
    ]
    spent = collections.Counter()
    for e in leaves:
        spent[e["name"]] += float(e.get("dur", 0.0))
    count = collections.Counter(e["name"] for e in leaves)
    decisions = done.ttft.size
    hottest = [
        (us / decisions, count[name] / decisions, name, sources[name][1], sources[name][2])
        for name, us in spent.most_common(10)
    ]
    return sum(kinds.values()) / decisions, [(k, n / decisions) for k, n in kinds.most_common(10)], hottest


def device_name() -> str:
    d = jax.devices()[0]
    kind = getattr(d, "device_kind", d.platform)
    if d.platform == "cpu":
        return f"cpu ({os.cpu_count()} cores)"
    return f"{d.platform} ({kind}) x{len(jax.devices())}"


def chunk_arg(text: str) -> str | int | None:
    """`--chunk`: "auto", "all" (None: every cluster at once) or a positive number of clusters."""
    if text in ("auto", "all"):
        return {"auto": "auto", "all": None}[text]
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected auto, all or a positive number, got {text!r}")
    return int(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", default="bursty")
    ap.add_argument(
        "--batch", type=int_at_least(1), nargs="*", default=[1, 256, 4096], help="vector env sizes"
    )
    ap.add_argument(
        "--jax-clusters", type=int_at_least(1), nargs="*", default=[1, 256, 4096], help="JAX rollout sizes"
    )
    ap.add_argument(
        "--gpu-sizes",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"also run the JAX rollout at {', '.join(f'{g:,}' for g in GPU_SIZES)} clusters "
        "(default: on a GPU or TPU only)",
    )
    ap.add_argument(
        "--baselines",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time the single Gymnasium environment and the reference simulator (the ratios' bases); "
        "--no-baselines with --batch and no sizes times the JAX rows only",
    )
    ap.add_argument(
        "--jax-routers",
        nargs="+",
        default=["round-robin", "least-tokens"],
        choices=list(ROUTERS),
        metavar="ROUTER",
    )
    ap.add_argument(
        "--chunk", default="auto", type=chunk_arg, help="clusters vmapped together (auto, all, or a number)"
    )
    ap.add_argument(
        "--budget-s",
        type=positive_float,
        default=180.0,
        help="skip a JAX size predicted to run longer than this",
    )
    ap.add_argument("--episode-length", type=int, default=128)
    ap.add_argument("--episodes", type=int_at_least(1), default=1, help="timed episodes per configuration")
    ap.add_argument("--json", help="also write the figures to this JSON file")
    ap.add_argument("--profile", action="store_true", help="only profile one step of one cluster (CPU us)")
    ap.add_argument(
        "--kernels", action="store_true", help="only count the XLA kernels run per routing decision"
    )
    ap.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="scenario settings (e.g. trace=PATH chunk_widths=[])",
    )
    args = ap.parse_args()
    with refusals(ap):
        run(args, parse_settings(args.set))


def run(args: argparse.Namespace, extra: dict) -> None:
    """Time what the command line asks for (`--kernels`, `--profile`, or the rates' table)."""
    if args.kernels:
        settings = {"episode_length": args.episode_length, **extra}
        per, kinds, hottest = kernels_per_decision(args.scenario, settings)
        print(
            f"{args.scenario}: {per:.1f} XLA kernels per routing decision, "
            f"episode_length {args.episode_length}"
        )
        for kind, n in kinds:
            print(f"  {kind:40s} {n:7.1f}")
        print("kernels with the most traced time (us and runs per decision; the profiler's cost included):")
        for us, n, name, shape, where in hottest:
            print(f"  {us:7.2f} {n:5.1f}  {name[:32]:32s} {shape[:32]:32s} {where}")
        return
    if args.profile:
        settings = {"episode_length": args.episode_length, **extra}
        print(
            f"{args.scenario}: CPU microseconds per routing step, one cluster, episode_length "
            f"{args.episode_length}, jax {jax.__version__} on {device_name()}"
        )
        for name, us in profile_step(args.scenario, settings):
            print(f"  {name:56s} {us:9.1f}")
        return
    chunk = args.chunk
    gpu = jax.default_backend() != "cpu" if args.gpu_sizes is None else args.gpu_sizes
    sizes = list(args.jax_clusters) + [g for g in GPU_SIZES if g not in args.jax_clusters]
    settings = {"episode_length": args.episode_length, **extra}
    console = Console(width=max(Console().width, 120))
    device = device_name()
    load_start = os.getloadavg()  # other work on the machine inflates wall times
    rates: dict[str, float | None] = {}
    entries: list[dict] = []

    def entry(name: str, engine: str, clusters: int, measured: tuple | None, **extra) -> None:
        rate = cpu_rate = None
        if measured is not None:
            decisions, wall, cpu = measured[:3]
            rate, cpu_rate = decisions / wall, decisions / cpu
            extra = {"decisions": decisions, "wall_s": wall, "cpu_s": cpu, **extra}
        rates[name] = rate
        entries.append(
            {
                "configuration": name,
                "engine": engine,
                "clusters": clusters,
                "decisions_per_s": rate,
                "decisions_per_cpu_s": cpu_rate,
                "scenario": args.scenario,
                "episode_length": args.episode_length,
                "device": device,
                "jax_version": jax.__version__,
                **extra,
            }
        )

    if args.baselines:
        with console.status("single Gymnasium environment"):
            entry("gymnasium env (1)", "gymnasium", 1, single_rate(args.scenario, settings, args.episodes))
        with console.status("reference simulator"):
            ref = reference_rate(args.scenario, settings, args.episodes)
            entry("reference simulator", "reference", 1, ref)
    for b in args.batch:
        with console.status(f"vector env x{b}"):
            rate = vector_rate(b, args.scenario, settings, args.episodes)
        entry(f"vector env ({b})", "vector env", b, rate)
    for router in args.jax_routers:
        last = None  # decisions/s of the previous size
        for c in sizes:
            name = f"jax rollout, {router} ({c})"
            if c in GPU_SIZES and c not in args.jax_clusters and not gpu:
                entry(name, "jax rollout", c, None, router=router, note="not measured (--gpu-sizes off)")
                continue
            predicted = None if last is None else 2 * c * args.episode_length / last  # untimed + timed
            if predicted is not None and predicted > args.budget_s:
                note = f"not measured (predicted {predicted:,.0f} s > --budget-s {args.budget_s:g})"
                entry(name, "jax rollout", c, None, router=router, note=note)
                continue
            with console.status(f"jax rollout, {router} x{c}"):
                measured = jax_rate(c, router, args.scenario, settings, chunk)
            entry(
                name,
                "jax rollout",
                c,
                measured[:3],
                router=router,
                compile_s=measured[3],
                bytes_per_cluster=measured[4],
                chunk=str(chunk),
            )
            last = measured[0] / measured[1]
    single = rates.get("gymnasium env (1)")
    reference_dps = rates.get("reference simulator")
    table = Table(
        title=f"decisions/s, scenario {args.scenario}, episode_length {args.episode_length}, "
        f"{device}, jax {jax.__version__} on {jax.default_backend()}, "
        f"load average {load_start[0]:.1f} -> {os.getloadavg()[0]:.1f}"
    )
    table.add_column("configuration")
    table.add_column("decisions/s", justify="right")
    table.add_column("x single env", justify="right")
    table.add_column("x reference", justify="right")
    table.add_column("per CPU-s", justify="right")
    table.add_column("compile s", justify="right")
    table.add_column("MiB/cluster", justify="right")
    for e in entries:
        r = e["decisions_per_s"]
        if r is None:
            table.add_row(e["configuration"], e.get("note", "not measured"), "", "", "", "", "")
            continue
        compile_s = f"{e['compile_s']:.1f}" if "compile_s" in e else ""
        mib = f"{e['bytes_per_cluster'] / 2**20:,.2f}" if e.get("bytes_per_cluster") else ""
        ratios = (f"{r / base:,.1f}" if base else "" for base in (single, reference_dps))
        table.add_row(
            e["configuration"], f"{r:,.0f}", *ratios, f"{e['decisions_per_cpu_s']:,.0f}", compile_s, mib
        )
    console.print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "scenario": args.scenario,
                    "episode_length": args.episode_length,
                    "device": device,
                    "jax_version": jax.__version__,
                    "load_average": {"start": load_start, "end": os.getloadavg()},
                    "rates": rates,
                    "entries": entries,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
