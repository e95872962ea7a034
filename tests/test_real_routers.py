"""burstgym's cache-aware rules against the real routers, decision by decision.

The real router (sglang-router 0.3.2, vllm-router 0.1.17: Rust wheels from PyPI, in the `dev`
extra) runs on 127.0.0.1 in front of four mock workers started here: small threaded HTTP servers
that answer the router's health and info probes and hold every `POST /generate` until the test
releases it, so the router's in-flight count per worker is known exactly at every decision. A
scripted request sequence (prompts sharing long prefixes, prompts sharing nothing, light and heavy
phases, then a worker that stops answering so that its load runs away) is sent one request at a
time; the worker that receives it is the router's decision. burstgym's rule is fed the signals the
real router reads: the longest common character prefix between the prompt and any prompt routed
to each worker (what its approximate radix tree holds when nothing is evicted), the prompt's
characters, and the in-flight load per worker, with the workers in the order the router lists
them (`GET /workers`). The rule must agree on every decision; where several workers tie (equally
long matches: the real router takes the tree node's first tenant) it must agree up to the tie.

`python tests/test_real_routers.py` prints the agreement table. Processes and servers are started
and stopped here, every wait is bounded, and each router's run takes a few seconds.
"""

from __future__ import annotations

import http.client
import json
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from itertools import permutations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agents.routers import make_rule
from burstgym.observation import RouterView

N_WORKERS = 4
WAIT_S = 10.0  # bound on any single wait for the router or a worker
# (rule in burstgym, launcher command, pip distribution, version it is checked against, the
# endpoint whose prompt it matches: vllm-router tokenizes /v1/completions through the worker's
# /v1/completions/render, and routes /generate by load alone)
ROUTERS = {
    "sglang-router": (
        "sglang-cache-aware",
        [sys.executable, "-m", "sglang_router.launch_router", "--log-level", "warn"],
        "sglang-router",
        "0.3.2",
        "/generate",
    ),
    "vllm-router": (
        "vllm-router",
        ["vllm-router", "--log-level", "warning"],
        "vllm-router",
        "0.1.17",
        "/v1/completions",
    ),
}


class Worker:
    """A mock inference server on 127.0.0.1 that holds each generate request until released."""

    def __init__(self, index: int, arrivals: list, lock: threading.Condition):
        self.index, self.arrivals, self.lock = index, arrivals, lock
        self.held: dict[str, threading.Event] = {}
        worker = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # one write per response, sent at once: no 40 ms delayed-ACK stall per request
            wbufsize = -1
            disable_nagle_algorithm = True

            def log_message(self, *args):  # quiet
                pass

            def reply(self, obj: dict) -> None:
                body = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):  # /health, /server_info, /model_info (no model_path), /get_load
                if self.path.startswith("/v1/models"):
                    return self.reply({"object": "list", "data": [{"id": "mock", "object": "model"}]})
                return self.reply({"status": "ok", "load": 0})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                if self.path.endswith("/render"):  # a tokenizer of one token per character
                    return self.reply({"token_ids": [ord(c) for c in body.get("prompt", "")]})
                text = body.get("text") or body.get("prompt") or ""
                release = threading.Event()
                with worker.lock:
                    worker.held[text] = release
                    worker.arrivals.append((worker.index, text))
                    worker.lock.notify_all()
                release.wait(WAIT_S * 6)
                self.reply({"text": "ok", "meta_info": {"finish_reason": {"type": "stop"}}})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        for event in list(self.held.values()):
            event.set()
        self.server.shutdown()
        self.server.server_close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(port: int, path: str) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)
    try:
        conn.request("GET", path)
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


def post_generate(port: int, path: str, text: str, done: list) -> None:
    payload = {"text": text} if path == "/generate" else {"model": "mock", "prompt": text}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S * 7)
    try:
        conn.request("POST", path, json.dumps(payload), {"Content-Type": "application/json"})
        conn.getresponse().read()
    finally:
        conn.close()
        done.append(text)


def common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def script(seed: int, n: int) -> list[tuple[str, int, bool]]:
    """`n` requests: (prompt, decisions to hold it for, whether it is meant for the stalled
    worker). Prompts share one of six long prefixes (or nothing); light, heavy and stalled phases."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz     "))
    word = lambda k: "".join(rng.choice(letters, k))  # noqa: E731
    prefixes = [word(int(rng.integers(300, 1200))) for _ in range(6)]
    out = []
    for k in range(n):
        phase = k * 4 // n  # 0 light, 1 heavy, 2 stalled worker, 3 light again
        if phase == 2 and rng.random() < 0.7:  # held until the phase ends
            out.append((prefixes[0] + word(int(rng.integers(10, 200))) + f"#{k}", n * 3 // 4 - k, True))
            continue
        shared = rng.random() < 0.75
        prompt = (prefixes[int(rng.integers(0, 6))] if shared else "") + word(int(rng.integers(20, 600)))
        hold = int(rng.integers(1, 4)) if phase in (0, 3) else int(rng.integers(15, 45))
        out.append((prompt + f"#{k}", hold, False))
    return out


@dataclass
class Agreement:
    decisions: int = 0
    exact: int = 0
    up_to_ties: int = 0
    branches: dict[str, int] = field(default_factory=lambda: {"hit": 0, "miss": 0, "imbalance": 0})
    disagreements: list = field(default_factory=list)


def _decide_fn(rule):
    """jit(decision of `rule` on a batch of views); the rule's own state is irrelevant here."""
    state = rule.init(N_WORKERS)

    def one(view):
        node, _ = rule.act(state, view, jnp.ones(N_WORKERS, bool))
        return node

    return jax.jit(jax.vmap(one))


def views(
    load: np.ndarray, match: np.ndarray, tree: np.ndarray, prompt: int, perms: np.ndarray
) -> RouterView:
    """The router's signals as burstgym views, one per worker order in `perms`."""
    b = perms.shape[0]
    z = np.zeros((b, N_WORKERS), np.float32)
    return RouterView(
        running=load[perms].astype(np.float32), waiting=z, kv_util=z, kv_used=z, prefill_tokens=z,
        prompt_tokens=z, window_age=z, phase=np.zeros((b, N_WORKERS), np.int32),
        hit_tokens=match[perms].astype(np.float32), cached_tokens=tree[perms].astype(np.float32),
        cache_used=z,
        capacity=np.ones((b, N_WORKERS), np.float32), prefill_rate=np.ones((b, N_WORKERS), np.float32),
        kv_tokens=np.ones((b, N_WORKERS), np.float32),
        accepts=np.ones((b, N_WORKERS), bool), block_size=np.ones((b, N_WORKERS), np.int32),
        prompt=np.full(b, prompt, np.float32), prefix_key=np.full(b, -1, np.int32),
        chunk_ids=np.zeros((b, 0), np.int32), chunk_end=np.zeros((b, 0), np.int32),
        step=np.ones(b, np.int32), since_last=np.zeros(b, np.float32), rate=np.ones(b, np.float32),
        time_to_go=np.ones(b, np.float32), clock=np.zeros(b, np.float32),
    )  # fmt: skip


def run_router(name: str, n_requests: int = 1200, seed: int = 0, rule: str | None = None) -> Agreement:
    """Drive the real router `name` through `script` and compare each decision with burstgym's
    rule (`rule`, default the one restating that router)."""
    rule_name, command, _, _, path = ROUTERS[name]
    rule = make_rule(rule or rule_name, cache_view="engine")  # the view carries the matches computed here
    decide = _decide_fn(rule)
    perms = np.array(list(permutations(range(N_WORKERS))))  # perms[0] is the router's own order
    lock = threading.Condition()
    arrivals: list = []
    workers = [Worker(i, arrivals, lock) for i in range(N_WORKERS)]
    port = free_port()
    # Each router also serves Prometheus metrics, on 29000 unless told; two routers under test at
    # once (pytest-xdist) would collide there, so each gets a free port on 127.0.0.1 of its own.
    cmd = [
        *command,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--policy",
        "cache_aware",
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(free_port()),
    ]
    cmd += ["--eviction-interval-secs", "3600", "--worker-urls", *(w.url for w in workers)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    threads: dict[str, threading.Thread] = {}
    try:
        deadline = time.monotonic() + WAIT_S * 3
        order = None
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited: {proc.stderr.read().decode()[-2000:]}")
            try:
                listed = get_json(port, "/workers")["workers"]
                if len(listed) == N_WORKERS and all(w.get("is_healthy", True) for w in listed):
                    order = [next(i for i, w in enumerate(workers) if w.url == x["url"]) for x in listed]
                    break
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.05)
        assert order is not None, f"{name} did not list {N_WORKERS} healthy workers within {WAIT_S * 3} s"
        routed: list[list[str]] = [[] for _ in range(N_WORKERS)]  # by position in the router's order
        load = np.zeros(N_WORKERS, np.int64)
        tree = np.zeros(N_WORKERS, np.int64)  # characters in each worker's part of the radix tree
        release_at: list[tuple[int, int, str]] = []  # (decision index, position, prompt)
        result = Agreement()
        stalled = None
        for k, (prompt, hold, to_stall) in enumerate(script(seed, n_requests)):
            # complete the requests due now, and wait until the router has seen them finish
            stall = stalled is not None and k < n_requests * 3 // 4
            due = [r for r in release_at if r[0] <= k and not (stall and r[1] == stalled)]
            if due:
                for r in due:
                    release_at.remove(r)
                    workers[order[r[1]]].held.pop(r[2]).set()
                    load[r[1]] -= 1
                for r in due:  # the client has its answer: the router counted the request done
                    threads.pop(r[2]).join(WAIT_S)
                until = time.monotonic() + WAIT_S
                while [w["load"] for w in get_json(port, "/workers")["workers"]] != load.tolist():
                    assert time.monotonic() < until, f"{name}: in-flight loads did not settle"
                    time.sleep(0.002)
            match = np.array([max((common_prefix(prompt, t) for t in texts), default=0) for texts in routed])
            ours = np.asarray(decide(views(load, match, tree, len(prompt), perms)))
            choices = {int(perms[i][ours[i]]) for i in range(len(perms))}  # what any worker order gives
            seen = len(arrivals)
            t = threading.Thread(target=post_generate, args=(port, path, prompt, []), daemon=True)
            t.start()
            threads[prompt] = t
            with lock:
                arrived = lock.wait_for(lambda n=seen: len(arrivals) > n, WAIT_S)
                assert arrived, f"{name}: request {k} not routed within {WAIT_S} s"
                worker, text = arrivals[seen]
            assert text == prompt
            real = order.index(worker)
            lo, hi = load.min(), load.max()
            branch = (
                "imbalance"
                if hi - lo > rule.balance_abs_threshold and hi > rule.balance_rel_threshold * lo
                else "hit"
                if match.max() / max(len(prompt), 1) > rule.cache_threshold
                else "miss"
            )
            result.decisions += 1
            result.branches[branch] += 1
            result.exact += int(ours[0] == real)
            result.up_to_ties += int(real in choices)
            if real not in choices:
                seen_by_us = (k, branch, load.tolist(), match.tolist(), len(prompt), real, int(ours[0]))
                result.disagreements.append(seen_by_us)
            if to_stall and stalled is None:
                stalled = real
            routed[real].append(prompt)
            tree[real] += len(prompt) - match[real]
            load[real] += 1
            release_at.append((k + hold, real, prompt))
        return result
    finally:
        for w in workers:  # answers every held request, then stops the server
            w.stop()
        for t in threads.values():
            t.join(WAIT_S)
        proc.kill()  # the routers drain for a grace period on SIGTERM; nothing is left to drain
        proc.wait(WAIT_S)


def _available(name: str) -> str | None:
    _, command, dist, version, _ = ROUTERS[name]
    from importlib import metadata

    try:
        installed = metadata.version(dist)
    except metadata.PackageNotFoundError:
        return f"{dist} is not installed (pip install -e '.[dev]' installs {dist}=={version})"
    if installed != version:
        return f"{dist} {installed} is installed; the rule is checked against {version}"
    if command[0] != sys.executable and shutil.which(command[0]) is None:
        return f"{command[0]} is not on PATH"
    return None


@pytest.mark.parametrize("name", list(ROUTERS))
def test_rule_agrees_with_the_real_router(name):
    reason = _available(name)
    if reason:
        pytest.skip(reason)
    res = run_router(name, n_requests=800)
    assert res.decisions == 800
    assert min(res.branches.values()) >= 20, res.branches  # every branch is exercised
    assert res.up_to_ties == res.decisions, res.disagreements[:5]
    assert res.exact >= 0.9 * res.decisions, (res.exact, res.decisions)


if __name__ == "__main__":
    from importlib import metadata

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
    print("| router | version | burstgym rule | decisions | exact | up to ties | hit / miss / imbalance |")
    print("|---|---|---|---|---|---|---|")
    runs = [(name, ROUTERS[name][0]) for name in ROUTERS] + [("sglang-router", "sglang-cache-aware-v0.2.3")]
    for name, rule in runs:
        reason = _available(name)
        if reason:
            print(f"| {name} | not run: {reason} | {rule} | | | | |")
            continue
        start = time.monotonic()
        r = run_router(name, n_requests=n, rule=rule)
        b = r.branches
        print(
            f"| {name} | {metadata.version(ROUTERS[name][2])} | `{rule}` | {r.decisions} | "
            f"{100 * r.exact / r.decisions:.1f}% | {100 * r.up_to_ties / r.decisions:.1f}% | "
            f"{b['hit']} / {b['miss']} / {b['imbalance']} |  ({time.monotonic() - start:.1f} s)"
        )
