"""`load` is relative to the analytic capacity of `burstgym.capacity`: below it a node's queue
stays bounded, above it the queue grows at the excess rate (queueing theory: a G/G/1 queue is
stable iff rho < 1, and the backlog of an overloaded one grows at lambda - mu)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import rollout

from burstgym import scenarios

E = 3000
# One slot width: the queue grows to hundreds, and what is checked here is queueing, not the
# narrow tables (tests/test_core.py checks those), so one compiled width keeps the test short.
ONE_NODE = dict(
    n_nodes=1,
    episode_length=E,
    queue_capacity=1000,
    slots=1100,
    slot_widths=(),
    end="cut",
    prompt_max=1024,
    output_max=512,
)


@pytest.mark.parametrize(
    "scheduler", [dict(scheduler="continuous", max_num_seqs=16), dict(scheduler="dynamic", max_batch_size=8)]
)
def test_load_is_relative_to_capacity(scheduler) -> None:
    """At load 0.9 the queue empties again and again; at 1.1 it ends near (lambda - mu) * T."""
    for load in (0.9, 1.1):
        cfg, params = scenarios.make("steady", load=load, **ONE_NODE, **scheduler)
        for seed in range(2):
            _, _, _, tr = rollout(cfg, params, seed, np.zeros(E, np.int64))
            assert (tr["error"] == 0).all()
            waiting = tr["waiting"][:, 0]
            if load < 1:
                assert waiting.max() < 0.05 * E and (waiting[E // 2 :] == 0).any()
            else:
                # (lambda - mu) * T with lambda = E / T and mu = lambda / load
                excess = (1.0 - 1.0 / load) * E
                assert 0.5 * excess < waiting[-1] < 1.5 * excess
