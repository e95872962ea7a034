"""Packed records (burstgym.record): the slot table and the node state."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from burstgym.types import NO_REQUEST, NodeState, Slots


def _slots(rng: np.random.Generator, shape: tuple[int, ...]) -> dict[str, np.ndarray]:
    return {
        f: (rng.normal(size=shape).astype(np.float32) if f in Slots._floats else rng.integers(-5, 9, shape))
        for f in Slots._fields
    }


def test_fields_read_back_as_given_and_replace_changes_only_the_named_ones():
    rng = np.random.default_rng(0)
    values = _slots(rng, (3, 5))
    slots = Slots(**values)
    assert slots.ints.shape == (3, 10, 5) and slots.floats.shape == (3, 3, 5)
    assert slots.ints.dtype == jnp.int32 and slots.floats.dtype == jnp.float32
    for f in Slots._fields:
        np.testing.assert_array_equal(getattr(slots, f), values[f])
    new = slots._replace(status=jnp.full((3, 5), 7), ttft=jnp.zeros((3, 5)), pin=1)
    changed = {"status": np.full((3, 5), 7), "ttft": np.zeros((3, 5)), "pin": np.ones((3, 5))}
    for f in Slots._fields:
        np.testing.assert_array_equal(getattr(new, f), changed.get(f, values[f]))
    assert new.status.dtype == jnp.int32 and new.ttft.dtype == jnp.float32
    # positional construction follows `_fields`, as a NamedTuple's
    again = Slots(*(values[f] for f in Slots._fields))
    np.testing.assert_array_equal(again.ints, slots.ints)
    assert list(again._asdict()) == list(Slots._fields)


def test_bad_fields_are_refused_by_name():
    values = _slots(np.random.default_rng(1), (2, 4))
    with pytest.raises(ValueError, match=r"Slots has no fields \['colour'\]"):
        Slots(**values)._replace(colour=1)
    with pytest.raises(TypeError, match=r"missing fields \['e2e'\]"):
        Slots(**{f: v for f, v in values.items() if f != "e2e"})
    with pytest.raises(TypeError, match="given twice"):
        Slots(values["req"], req=values["req"], **{f: v for f, v in values.items() if f != "req"})


def test_a_record_is_a_pytree_of_its_two_arrays():
    slots = Slots.full((2, 4), jnp.float32)
    assert len(jax.tree.leaves(slots)) == 2
    np.testing.assert_array_equal(slots.req, NO_REQUEST)
    np.testing.assert_array_equal(slots.hit, -1)
    assert np.isnan(np.asarray(slots.e2e)).all() and (np.asarray(slots.computed) == 0).all()
    # leading axes map as a NamedTuple's fields would: vmap, a cut of the clusters, jit
    sliced = jax.tree.map(lambda x: x[1], slots)
    assert sliced.status.shape == (4,)
    doubled = jax.jit(jax.vmap(lambda s: s._replace(prompt=s.prompt + 2)))(slots)
    np.testing.assert_array_equal(doubled.prompt, 2)
    assert isinstance(doubled, Slots)


def test_node_state_packs_its_ints_and_floats():
    nodes = NodeState(**{f: jnp.arange(4) for f in NodeState._fields})
    assert nodes.ints.shape == (10, 4) and nodes.floats.shape == (10, 4)
    assert nodes.phase.dtype == jnp.int32 and nodes.last_time.dtype == jnp.float32
