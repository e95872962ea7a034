"""`predicted-latency`: llm-d's predicted-latency routing, the production learned baseline.

The rule, as llm-d ships it (sources checked, cited by file and commit):

- A latency predictor trained online. The training sidecar
  (kubernetes-sigs/gateway-api-inference-extension `latencypredictor/training_server.py`, release
  v1.5.0, commit df9f8909) fits a TTFT model and a TPOT model on the requests that finished, each
  sample holding the features of the pod it was sent to *at dispatch* and the latency the response
  stream showed. TTFT features: queued or not, KV-cache usage, input tokens, waiting requests,
  running requests, prefill tokens in flight, prefix-cache score and the uncached input
  `(1 - prefix) x input`; TPOT features: the same without the prefix terms (the decode tokens in
  flight and tokens generated are 0 for a monolithic pod, so they are left out here). One model
  serves every pod (pod identity is not a feature). It retrains every `LATENCY_RETRAINING_INTERVAL_SEC`
  (10 s in llm-d-inference-scheduler's chart, `config/charts/epplib/values.yaml`, commit 520af47)
  once it holds `LATENCY_MIN_SAMPLES_FOR_RETRAIN_FRESH` (10) samples; until then a default model
  predicts 10 ms for everything. With `LATENCY_ENSEMBLE_MODE` (default on) and at least 200 samples
  in each of the four splits it also trains separate models for pods with and without a queue and
  predicts with the one that matches. The chart's objective is the mean (`LATENCY_OBJECTIVE_TYPE`).
- The scheduling chain (llm-d-inference-scheduler `config/charts/epplib/templates/_config.yaml`,
  commit 520af47): a strict prefix-cache affinity filter (keep the pods whose prefix score is at
  least 0.99, unless none is, with probability 1% of skipping the gate, and unless the best such
  pod's predicted TTFT is more than 5 s above the best pod's: `scheduling/filter/prefixcacheaffinity`),
  the SLO headroom tier filter (pods meeting both SLOs, kept with probability 99% when both tiers
  exist: `filter/sloheadroomtier`), a loose affinity filter (threshold 0.80), the latency scorer
  (`scorer/latency/plugin.go`: with positive headroom the pods closest to their SLO score highest,
  "least"; with none, idle pods (no request in flight) first, then the least severe deficit; TTFT
  and TPOT headrooms normalised within the set and blended 0.8 / 0.2; score `int((1 - blend) 100)
  + 1`), and the weighted random picker (`picker/weightedrandom`: probability proportional to the
  score). Without SLO headers the headroom is `0 - predicted`, so it picks pods of low predicted
  latency, at random in proportion to their score.

The regressor: llm-d trains XGBoost by default and supports Bayesian ridge (`bayesian_ridge`:
scikit-learn's `BayesianRidge` on standardised features). Here the Bayesian ridge runs in JAX
(`fit_bayesian_ridge`, scikit-learn's evidence maximisation on the sample's Gram matrix), so the
whole router, training included, runs inside the rollout engine's compiled episode; gradient-boosted
trees would have to leave it for a library at every retrain.

What the router observes (`streamed`): a request's TTFT once its first token has streamed, its
end-to-end latency and its output length once it has finished, a drop at once; never a request's
future. The samples it trains on are those of the requests it routed in the episode, plus the
`warm` samples given at construction (`warm_samples`: a predictor that has been running on the
same traffic before the episode, as a deployed one has). It needs the cluster's state only to read
those streams (`reads_state`). Differences from llm-d: one sample per request for TPOT (llm-d
samples tokens along the stream), samples are not kept in llm-d's per-bucket windows of 500, the
prediction servers' 30 s model sync is not modelled (predictions use the latest training), and
the prefill tokens in flight count the arriving request's own prompt at prediction as at training.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from agents.routers.base import CACHE_VIEWS, BatchedRouter
from agents.routers.index import empty as empty_index
from agents.routers.index import matched as index_matched
from agents.routers.index import record
from agents.routers.llm_d import LLMD
from burstgym.env import BurstBalance
from burstgym.observation import RouterView
from burstgym.types import DONE, RUNNING, EnvConfig, EnvParams, State
from burstgym.workload.base import digest

# Raw features recorded at dispatch, per request (the columns of `Samples.features`).
RAW = ("kv_cache", "input_tokens", "waiting", "running", "prefill_in_flight", "prefix_score")
DEFAULT_PREDICTION_S = 0.010  # llm-d's default model before the first training: 10 ms


class Ridge(NamedTuple):
    """A fitted Bayesian ridge on standardised features: `y = y_mean + ((x - x_mean) / x_scale) @ coef`."""

    x_mean: jax.Array  # [d]
    x_scale: jax.Array  # [d]
    y_mean: jax.Array  # []
    coef: jax.Array  # [d]


def constant_ridge(d: int, value: float) -> Ridge:
    """A model that predicts `value` for every input."""
    return Ridge(jnp.zeros(d), jnp.ones(d), jnp.float32(value), jnp.zeros(d))


def fit_bayesian_ridge(
    x: jax.Array,
    y: jax.Array,
    weight: jax.Array,
    max_iter: int = 300,
    tol: float = 1e-3,
    prior: float = 1e-6,
) -> Ridge:
    """scikit-learn's `StandardScaler` + `BayesianRidge` (default priors, evidence maximisation) on
    the rows of `x` [M, d], `y` [M] with `weight` 1 (0: not in the sample), in JAX.

    As scikit-learn: features standardised (population std, a constant column left at scale 1),
    `y` centred; precision `alpha` starts at 1 / var(y), `lambda` at 1; each iteration takes the
    posterior mean `coef = (Z'Z + lambda / alpha I)^-1 Z'y`, then `gamma = sum alpha e / (lambda +
    alpha e)` over the eigenvalues e of Z'Z, `lambda = (gamma + 2 prior) / (|coef|^2 + 2 prior)`,
    `alpha = (n - gamma + 2 prior) / (|y - Z coef|^2 + 2 prior)`, until coef moves by less than `tol`
    (sum of absolute changes); the final coef uses the last alpha and lambda."""
    x = jnp.asarray(x, jnp.float32)
    y = jnp.asarray(y, jnp.float32)
    w = jnp.asarray(weight, jnp.float32)
    n = jnp.maximum(w.sum(), 1.0)
    x_mean = (w[:, None] * x).sum(axis=0) / n
    var = (w[:, None] * (x - x_mean) ** 2).sum(axis=0) / n
    x_scale = jnp.where(var > 1e-12 * (1.0 + x_mean**2), jnp.sqrt(var), 1.0)
    z = jnp.where(w[:, None] > 0, (x - x_mean) / x_scale, 0.0)
    y_mean = (w * y).sum() / n
    yc = jnp.where(w > 0, y - y_mean, 0.0)
    gram = z.T @ z
    zy = z.T @ yc
    yy = yc @ yc
    eig, vec = jnp.linalg.eigh(gram)
    eig = jnp.maximum(eig, 0.0)
    vy = vec.T @ zy

    def coef_of(alpha, lam):
        return vec @ (vy / (eig + lam / alpha))

    def body(carry):
        i, alpha, lam, old, _ = carry
        coef = coef_of(alpha, lam)
        rss = jnp.maximum(yy - 2.0 * coef @ zy + coef @ gram @ coef, 0.0)
        gamma = jnp.sum(alpha * eig / (lam + alpha * eig))
        lam = (gamma + 2.0 * prior) / (coef @ coef + 2.0 * prior)
        alpha = (n - gamma + 2.0 * prior) / (rss + 2.0 * prior)
        done = (i > 0) & (jnp.abs(old - coef).sum() < tol)
        return i + 1, alpha, lam, coef, done

    def cond(carry):
        return (carry[0] < max_iter) & ~carry[4]

    alpha0 = 1.0 / (yy / n + jnp.finfo(jnp.float32).eps)
    init = (jnp.int32(0), alpha0, jnp.float32(1.0), jnp.zeros_like(zy), jnp.bool_(False))
    _, alpha, lam, _, _ = jax.lax.while_loop(cond, body, init)
    return Ridge(x_mean, x_scale, y_mean, coef_of(alpha, lam))


def predict(model: Ridge, x: jax.Array) -> jax.Array:
    """The posterior mean of `model` at `x` [..., d]."""
    return model.y_mean + ((x - model.x_mean) / model.x_scale) @ model.coef


def ttft_features(raw: jax.Array) -> jax.Array:
    """[..., 8] llm-d's TTFT features (Bayesian ridge set) from raw features [..., len(RAW)]."""
    kv, tokens, waiting, running, prefill, prefix = (raw[..., i] for i in range(len(RAW)))
    queued = (waiting > 0).astype(raw.dtype)
    return jnp.stack(
        [queued, kv, tokens, waiting, running, prefill, prefix, (1.0 - prefix) * tokens], axis=-1
    )


def tpot_features(raw: jax.Array) -> jax.Array:
    """[..., 6] llm-d's TPOT features from raw features [..., len(RAW)]."""
    kv, tokens, waiting, running, prefill, _ = (raw[..., i] for i in range(len(RAW)))
    queued = (waiting > 0).astype(raw.dtype)
    return jnp.stack([queued, kv, tokens, waiting, running, prefill], axis=-1)


class Streamed(NamedTuple):
    """What a router sees of each request of the episode through its response stream; all [E]."""

    ttft: jax.Array  # float, seconds to the first token once it streamed (nan before)
    e2e: jax.Array  # float, seconds to the last token once finished (nan before)
    output: jax.Array  # float, output tokens once finished (nan before)
    dropped: jax.Array  # bool, refused by its node


def streamed(state: State) -> Streamed:
    """The response streams of a cluster's requests so far: first tokens of requests still running
    (their slots) and of finished ones (the log), latencies and token counts of finished ones."""
    log = state.log
    s = state.slots
    live = ((s.status == RUNNING) | (s.status == DONE)) & jnp.isfinite(s.ttft)
    at = jnp.where(live, s.req, log.ttft.shape[0]).reshape(-1)
    ttft = log.ttft.at[at].set(s.ttft.reshape(-1), mode="drop")
    ttft = jnp.where(jnp.isfinite(log.ttft), log.ttft, ttft)
    done = jnp.isfinite(log.e2e)
    e = log.e2e.shape[0]
    output = jnp.where(done, state.requests.output[:e].astype(log.e2e.dtype), jnp.nan)
    return Streamed(ttft, log.e2e, output, log.dropped)


class Samples(NamedTuple):
    """Training samples: raw features at dispatch and the latencies observed (nan: not observed)."""

    features: jax.Array  # [M, len(RAW)] float
    ttft: jax.Array  # [M] float, seconds
    e2e: jax.Array  # [M] float, seconds
    output: jax.Array  # [M] float, tokens


def empty_samples(m: int = 0) -> Samples:
    """`m` unobserved samples."""
    nan = jnp.full(m, jnp.nan, jnp.float32)
    return Samples(jnp.zeros((m, len(RAW)), jnp.float32), nan, nan, nan)


class Models(NamedTuple):
    """The predictor's models: one over all samples and one per queue regime, for TTFT and TPOT."""

    ttft: Ridge
    tpot: Ridge
    ttft_noqueue: Ridge
    ttft_queued: Ridge
    tpot_noqueue: Ridge
    tpot_queued: Ridge
    gated: jax.Array  # [] bool, every regime had enough samples: predict with the regime's model


def default_models() -> Models:
    """llm-d's untrained predictor: 10 ms for every TTFT and TPOT."""
    t, p = constant_ridge(8, DEFAULT_PREDICTION_S), constant_ridge(6, DEFAULT_PREDICTION_S)
    return Models(t, p, t, t, p, p, jnp.bool_(False))


class PLState(NamedTuple):
    """The router's state in one cluster."""

    counter: jax.Array  # [] int32, decisions made this episode
    key: jax.Array  # [2] uint32, raw PRNG key data (exploration, the weighted random picker)
    last_train: jax.Array  # [] float, clock of the last training (-inf: never)
    node: jax.Array  # [E] int32, node each request went to (-1: not yet routed)
    samples: Samples  # [E] the episode's requests: features at dispatch, latencies as observed
    models: Models
    index: Any  # the approximate prefix index of the prompts it routed (agents.routers.index; () unused)


def labels(s: Samples, streaming: bool) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(TTFT-model target, its mask, TPOT target, its mask) of samples: the TTFT model learns TTFT
    in streaming mode, the end-to-end latency otherwise; TPOT needs an output of at least 2 tokens."""
    first = s.ttft if streaming else s.e2e
    ok_first = jnp.isfinite(first) & (first > 0)
    tpot = (s.e2e - s.ttft) / jnp.maximum(s.output - 1.0, 1.0)
    ok_tpot = jnp.isfinite(tpot) & (s.output > 1) & (tpot > 0) & streaming
    return jnp.where(ok_first, first, 0.0), ok_first, jnp.where(ok_tpot, tpot, 0.0), ok_tpot


def train(s: Samples, streaming: bool, min_samples: int, ensemble_min: int, old: Models) -> Models:
    """llm-d's training pass over samples `s`: each model retrained where it has `min_samples`, the
    queue-regime models where every regime of both targets has `ensemble_min` (else kept)."""
    y_first, ok_first, y_tpot, ok_tpot = labels(s, streaming)
    x_first, x_tpot = ttft_features(s.features), tpot_features(s.features)
    queued = s.features[:, RAW.index("waiting")] > 0

    def fit_or_keep(x, y, ok, model):
        enough = ok.sum() >= min_samples
        return jax.lax.cond(enough, lambda: fit_bayesian_ridge(x, y, ok), lambda: model)

    splits = [ok_first & ~queued, ok_first & queued, ok_tpot & ~queued, ok_tpot & queued]
    gated = jnp.all(jnp.stack([m.sum() >= ensemble_min for m in splits]))

    def fit_regimes():
        return (
            fit_bayesian_ridge(x_first, y_first, splits[0]),
            fit_bayesian_ridge(x_first, y_first, splits[1]),
            fit_bayesian_ridge(x_tpot, y_tpot, splits[2]),
            fit_bayesian_ridge(x_tpot, y_tpot, splits[3]),
        )

    regimes = jax.lax.cond(
        gated, fit_regimes, lambda: (old.ttft_noqueue, old.ttft_queued, old.tpot_noqueue, old.tpot_queued)
    )
    return Models(
        fit_or_keep(x_first, y_first, ok_first, old.ttft),
        fit_or_keep(x_tpot, y_tpot, ok_tpot, old.tpot),
        *regimes,
        gated | old.gated,
    )


def predictions(models: Models, raw: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(TTFT-model, TPOT) predictions [N] for per-node raw features [N, len(RAW)]."""
    xf, xt = ttft_features(raw), tpot_features(raw)
    queued = raw[:, RAW.index("waiting")] > 0
    first = jnp.where(
        models.gated,
        jnp.where(queued, predict(models.ttft_queued, xf), predict(models.ttft_noqueue, xf)),
        predict(models.ttft, xf),
    )
    tpot = jnp.where(
        models.gated,
        jnp.where(queued, predict(models.tpot_queued, xt), predict(models.tpot_noqueue, xt)),
        predict(models.tpot, xt),
    )
    return first, tpot


def affinity_filter(
    candidates: jax.Array,
    prefix: jax.Array,
    ttft: jax.Array,
    threshold: float,
    explore: jax.Array,
    epsilon: float,
    max_penalty_s: float,
) -> jax.Array:
    """llm-d's prefix-cache affinity filter: the candidates whose prefix score reaches `threshold`,
    unless at most one candidate is left, the exploration draw `explore` (uniform) falls below
    `epsilon`, none is sticky, or the best sticky node's predicted TTFT exceeds the best other
    candidate's by more than `max_penalty_s` (0: never broken)."""
    sticky = candidates & (prefix >= threshold)
    others = candidates & ~sticky
    best_sticky = jnp.min(jnp.where(sticky, ttft, jnp.inf))
    best_other = jnp.min(jnp.where(others, ttft, jnp.inf))
    broken = (max_penalty_s > 0) & others.any() & (best_sticky - best_other > max_penalty_s)
    keep = (candidates.sum() > 1) & (explore >= epsilon) & sticky.any() & ~broken
    return jnp.where(keep, sticky, candidates)


def _bucket_scores(
    members: jax.Array, h_first: jax.Array, h_tpot: jax.Array, weights, least: bool
) -> jax.Array:
    """The latency scorer's `scoreBucket`: headroom magnitudes normalised within `members`, blended,
    mapped to (0, 1.01] ("least": closest to the SLO scores highest; "most": the opposite)."""
    a_first, a_tpot = jnp.abs(h_first), jnp.abs(h_tpot)
    lo_f = jnp.min(jnp.where(members, a_first, jnp.inf))
    hi_f = jnp.max(jnp.where(members, a_first, -jnp.inf))
    lo_t = jnp.min(jnp.where(members, a_tpot, jnp.inf))
    hi_t = jnp.max(jnp.where(members, a_tpot, -jnp.inf))
    eps = 1e-9
    range_f, range_t = hi_f - lo_f, hi_t - lo_t
    alpha, beta = weights
    total = alpha + beta
    alpha, beta = (alpha / total, beta / total) if total > 0 else (1.0, 0.0)
    alpha, beta = (
        jnp.where(
            (range_f <= eps) & (range_t > eps), 0.0, jnp.where((range_t <= eps) & (range_f > eps), 1.0, alpha)
        ),
        jnp.where(
            (range_f <= eps) & (range_t > eps), 1.0, jnp.where((range_t <= eps) & (range_f > eps), 0.0, beta)
        ),
    )
    n_f = jnp.where(range_f > eps, (a_first - lo_f) / jnp.where(range_f > eps, range_f, 1.0), 0.5)
    n_t = jnp.where(range_t > eps, (a_tpot - lo_t) / jnp.where(range_t > eps, range_t, 1.0), 0.5)
    blend = alpha * n_f + beta * n_t
    w = jnp.floor((1.0 - blend if least else blend) * 100.0) + 1.0
    return jnp.where(members, w / 100.0, 0.0)


def latency_scores(
    candidates: jax.Array, h_first: jax.Array, h_tpot: jax.Array, dispatched: jax.Array, weights, least: bool
) -> jax.Array:
    """llm-d's latency scorer over the candidates: positive headroom first (with the configured
    strategy), else idle nodes, else the least severe deficit bucket (TPOT only, TTFT only, both)."""
    negative = (h_first < 0) | (h_tpot < 0)
    positive = candidates & ~negative
    idle = candidates & negative & (dispatched == 0)
    tpot_only = candidates & (h_first >= 0) & (h_tpot < 0)
    first_only = candidates & (h_first < 0) & (h_tpot >= 0)
    both = candidates & (h_first < 0) & (h_tpot < 0)
    bucket = jnp.where(tpot_only.any(), tpot_only, jnp.where(first_only.any(), first_only, both))
    members = jnp.where(positive.any(), positive, jnp.where(idle.any(), idle, bucket))
    return jnp.where(
        positive.any(),
        _bucket_scores(members, h_first, h_tpot, weights, least),
        _bucket_scores(members, h_first, h_tpot, weights, True),
    )


def weighted_random(key: jax.Array, scores: jax.Array, candidates: jax.Array) -> jax.Array:
    """llm-d's weighted random picker: probability proportional to the score (A-Res keys
    `u^(1 / score)`), uniform over the candidates when no score is positive."""
    k1, k2 = jax.random.split(key)
    u = jnp.maximum(jax.random.uniform(k1, scores.shape), 1e-10)
    keys = jnp.where(scores > 0, u ** (1.0 / jnp.where(scores > 0, scores, 1.0)), -1.0)
    uniform = jnp.where(candidates, jax.random.uniform(k2, scores.shape), -1.0)
    return jnp.where((scores > 0).any(), jnp.argmax(keys), jnp.argmax(uniform)).astype(jnp.int32)


@dataclass(frozen=True, eq=False)
class PredictedLatency:
    """The `predicted-latency` router for episodes of `episode_length` arrivals (see the module docstring).

    `slo`: (TTFT s, TPOT s) targets sent with every request (None: no SLO headers, llm-d's default);
    `streaming`: train TTFT and TPOT models (True) or one end-to-end model (llm-d's non-streaming
    mode); `warm`: samples the predictor was trained on before the episode; `cache_view`: the prefix
    scores from the index of the prompts it routed ("router", llm-d's approximate prefix producer,
    the index of `agents.routers.llm_d.LLMD`) or from the engines' caches ("engine")."""

    episode_length: int
    slo: tuple[float, float] | None = None
    streaming: bool = True
    warm: Samples = dataclasses.field(default_factory=empty_samples)
    cache_view: str = "router"
    retrain_interval_s: float = 10.0
    min_samples: int = 10
    ensemble_min: int = 200
    strict_threshold: float = 0.99
    loose_threshold: float = 0.80
    exploration: float = 0.01
    max_ttft_penalty_s: float = 5.0
    headroom_weights: tuple[float, float] = (0.8, 0.2)
    strategy: str = "least"
    name: str = "predicted-latency"
    seed: int = 0
    family: ClassVar[str] = "learned"
    reads_state: ClassVar[bool] = True  # burstgym.rollout passes the cluster's State (for `streamed`)

    def __post_init__(self) -> None:
        if self.strategy not in ("least", "most"):
            raise ValueError(f"predicted-latency strategy must be 'least' or 'most', got {self.strategy!r}")
        if self.cache_view not in CACHE_VIEWS:
            raise ValueError(f"cache_view must be one of {', '.join(CACHE_VIEWS)}, got {self.cache_view!r}")
        if self.episode_length < 1:
            raise ValueError(f"episode_length must be >= 1, got {self.episode_length}")
        object.__setattr__(self, "warm", Samples(*(np.asarray(x, np.float32) for x in self.warm)))

    @classmethod
    def for_scenario(
        cls, cfg: EnvConfig, params: EnvParams, slo: bool = False, **kwargs: Any
    ) -> PredictedLatency:
        """The router for a scenario's episodes; `slo=True` sends the scenario's TTFT and TPOT targets."""
        targets = (float(params.ttft_slo), float(params.tpot_slo)) if slo else None
        return cls(cfg.episode_length, slo=targets, **kwargs)

    def _key(self) -> tuple:
        fields = tuple(
            digest(*self.warm) if f.name == "warm" else getattr(self, f.name)
            for f in dataclasses.fields(self)
        )
        return (type(self), fields)

    def __hash__(self) -> int:
        return hash(self._key())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PredictedLatency) and self._key() == other._key()

    def replace(self, **changes: Any) -> PredictedLatency:
        """A copy with `changes` (dataclasses.replace)."""
        return dataclasses.replace(self, **changes)

    def _pool(self, episode: Samples) -> Samples:
        warm = Samples(*(jnp.asarray(x) for x in self.warm))
        return Samples(*(jnp.concatenate([w, e]) for w, e in zip(warm, episode, strict=True)))

    def init(self, n_nodes: int, seed: Any = None, stream: Any = 0) -> PLState:
        """A fresh episode's state: the warm samples' models, or llm-d's default model without any."""
        seed = self.seed if seed is None else seed
        key = jax.random.key(jnp.asarray(seed, jnp.uint32))
        key = jax.random.fold_in(key, jnp.asarray(stream, jnp.uint32))
        e = self.episode_length
        models = default_models()
        if self.warm.ttft.shape[0]:
            models = train(
                self._pool(empty_samples(0)), self.streaming, self.min_samples, self.ensemble_min, models
            )
        return PLState(
            counter=jnp.int32(0),
            key=jax.random.key_data(key),
            last_train=jnp.float32(-jnp.inf),
            node=jnp.full(e, -1, jnp.int32),
            samples=empty_samples(e),
            models=models,
            index=empty_index(LLMD.index, n_nodes) if self.cache_view == "router" else (),
        )

    def observe(self, state: PLState, seen: Streamed) -> PLState:
        """Record what the streams show of the requests this router sent."""
        s = state.samples
        mine = state.node >= 0
        return state._replace(
            samples=s._replace(
                ttft=jnp.where(mine & self.streaming, seen.ttft, jnp.nan),
                e2e=jnp.where(mine & ~seen.dropped, seen.e2e, jnp.nan),
                output=jnp.where(mine & ~seen.dropped, seen.output, jnp.nan),
            )
        )

    def in_flight(self, state: PLState, seen: Streamed, n_nodes: int) -> tuple[jax.Array, jax.Array]:
        """([N] requests sent and not finished, [N] their prompt tokens not yet past the first token):
        llm-d's dispatched request count and prefill tokens in flight, kept by the router."""
        node = jnp.where(state.node >= 0, state.node, n_nodes)
        open_ = (state.node >= 0) & ~seen.dropped & ~jnp.isfinite(seen.e2e)
        # streaming: a prompt leaves the count at its first token; otherwise at the response's end
        prefilling = open_ & ~jnp.isfinite(seen.ttft) if self.streaming else open_
        tokens = state.samples.features[:, RAW.index("input_tokens")]
        dispatched = jax.ops.segment_sum(open_.astype(jnp.float32), node, n_nodes + 1)[:n_nodes]
        prefill = jax.ops.segment_sum(jnp.where(prefilling, tokens, 0.0), node, n_nodes + 1)[:n_nodes]
        return dispatched, prefill

    def act(
        self, state: PLState, view: RouterView, mask: jax.Array, cluster_state: State, params: EnvParams
    ) -> tuple[jax.Array, PLState]:
        """`act_streamed` on the streams of the cluster's requests (`streamed`): all it reads of the
        cluster's state."""
        return self.act_streamed(state, view, mask, streamed(cluster_state))

    def act_streamed(
        self, state: PLState, view: RouterView, mask: jax.Array, seen: Streamed
    ) -> tuple[jax.Array, PLState]:
        """Observe the streams, retrain when due, predict every node's latency, pick (module docstring)."""
        n = view.running.shape[0]
        state = self.observe(state, seen)
        clock = jnp.asarray(view.clock, jnp.float32)
        due = clock - state.last_train >= self.retrain_interval_s
        samples = self._pool(state.samples)
        _, ok_first, _, ok_tpot = labels(samples, self.streaming)
        due = due & (ok_first.sum() + ok_tpot.sum() >= self.min_samples)
        models = jax.lax.cond(
            due,
            lambda: train(samples, self.streaming, self.min_samples, self.ensemble_min, state.models),
            lambda: state.models,
        )
        state = state._replace(last_train=jnp.where(due, clock, state.last_train), models=models)

        dispatched, prefill = self.in_flight(state, seen, n)
        prompt = view.prompt
        block = jnp.maximum(view.block_size, 1).astype(prompt.dtype)
        hit = index_matched(state.index, LLMD.index, view) if self.cache_view == "router" else view.hit_tokens
        prefix = jnp.floor(hit / block) / jnp.maximum(jnp.ceil(prompt / block), 1.0)
        columns = {
            "kv_cache": view.kv_util,
            "input_tokens": jnp.broadcast_to(prompt, (n,)),
            "waiting": view.waiting,
            "running": view.running,
            "prefill_in_flight": prefill + prompt,
            "prefix_score": prefix,
        }
        raw = jnp.stack([columns[c] for c in RAW], axis=1).astype(jnp.float32)
        first, tpot = predictions(state.models, raw)
        if self.slo is None:
            h_first, h_tpot = -first, -tpot
        else:
            h_first, h_tpot = self.slo[0] - first, self.slo[1] - tpot
        if not self.streaming:
            h_tpot = jnp.zeros_like(h_tpot)

        key, k_strict, k_tier, k_loose, k_pick = jax.random.split(jax.random.wrap_key_data(state.key), 5)
        u_strict, u_tier, u_loose = (jax.random.uniform(k) for k in (k_strict, k_tier, k_loose))
        cand = jnp.asarray(mask, bool)
        penalty = self.max_ttft_penalty_s
        cand = affinity_filter(
            cand, prefix, first, self.strict_threshold, u_strict, self.exploration, penalty
        )
        positive = cand & (h_first >= 0) & (h_tpot >= 0)
        split = positive.any() & (cand & ~positive).any()
        cand = jnp.where(split, jnp.where(u_tier < self.exploration, cand & ~positive, positive), cand)
        cand = affinity_filter(cand, prefix, first, self.loose_threshold, u_loose, self.exploration, penalty)
        scores = latency_scores(
            cand, h_first, h_tpot, dispatched, self.headroom_weights, self.strategy == "least"
        )
        action = weighted_random(k_pick, scores, cand)

        k = jnp.minimum(view.step, self.episode_length - 1)
        index = record(state.index, LLMD.index, view, action) if self.cache_view == "router" else state.index
        state = state._replace(
            counter=state.counter + 1,
            key=jax.random.key_data(key),
            node=state.node.at[k].set(action),
            samples=state.samples._replace(features=state.samples.features.at[k].set(raw[action])),
            index=index,
        )
        return action, state


class StreamedRouter(BatchedRouter):
    """A `PredictedLatency` router over a batch of clusters, step by step in NumPy (the face a
    gateway or a Python user drives): `reset(n_envs)`, then `router(obs, mask, view, seen)` with
    `view` a batched `RouterView` and `seen` the batched `Streamed` observations of each cluster's
    requests so far ([B, E] per field; `streamed` of each cluster's state, or a gateway's own record
    of its response streams). `jit(vmap(rule.act_streamed))`, the rule the engine runs."""

    def __init__(self, rule: PredictedLatency, n_nodes: int):
        super().__init__(rule, n_nodes, act=rule.act_streamed)

    def __call__(self, obs: Any, mask: np.ndarray | None, view: RouterView, seen: Streamed) -> np.ndarray:
        return super().__call__(obs, mask, view, seen)


def warm_samples(
    cfg: EnvConfig, params: EnvParams, batch: Any, seeds: Sequence[int], router: int = 0
) -> Samples:
    """The samples of whole episodes a `PredictedLatency` router ran: router number `router` of the
    `burstgym.rollout.EpisodeBatch` `batch` on `seeds`. Each routed request's features at dispatch
    (its final router state) with the latencies it had once the episode drained and its output
    length (the episode's request stream, `BurstBalance.reset` on its seed): what a predictor that
    ran on that traffic before has seen. Dropped requests are left out. The batch must hold its
    router states (`rollout(..., keep_router_state=True)`)."""
    if batch.router_state is None:
        raise ValueError(
            "warm_samples needs the batch's router states: run it with rollout(..., keep_router_state=True)"
        )
    rows = slice(router * len(seeds), (router + 1) * len(seeds))
    state = jax.tree.map(lambda x: np.asarray(x)[rows], batch.router_state[router])
    core = BurstBalance(cfg)
    e = cfg.episode_length
    output = np.stack(
        [np.asarray(core.reset(jax.random.key(int(seed)), params)[1].requests.output[:e]) for seed in seeds]
    ).astype(np.float32)
    seen = (state.node >= 0) & ~np.asarray(batch.dropped[rows]) & np.isfinite(batch.e2e[rows])
    return Samples(
        state.samples.features[seen].astype(np.float32),
        np.asarray(batch.ttft[rows], np.float32)[seen],
        np.asarray(batch.e2e[rows], np.float32)[seen],
        output[seen],
    )
