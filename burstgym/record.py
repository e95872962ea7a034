"""Records: named fields of one shape, stored as one int32 array and one float array.

A state with many small fields of one shape (a node's slot table: 13 fields of [N, S]) costs a
kernel per field wherever XLA:CPU cannot fuse the fields' operations together: a select of the
whole table, a copy of a loop or branch carry, the scatter that compacts it, the slice that
narrows it. A `Record` keeps its integer fields in one array and its float fields in another,
the field on the axis before the last, so each of those operations is one kernel per dtype
instead of one per field (docs/performance.md, "Packed records").

For fields of shape `[..., S]` the arrays are `[..., F, S]`, so a field is a contiguous run of
its array. A subclass names its fields and their kinds; each
field reads as an attribute (a slice, which XLA fuses into its consumer), `_replace` and the
constructor work as a NamedTuple's do, and the record is a pytree of its two arrays.
`jax.tree.map` over a record maps the two arrays: a function of the leading axes (vmap, a select
along the nodes, a cut of the clusters) or of the last axis (`burstgym.env`'s slot widths) works
unchanged; one of the axis before the last must leave the field axis alone.
"""

from __future__ import annotations

from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np


class Record:
    """Named fields of one shape `[..., S]` (at least one axis) in two arrays: `ints`
    ([..., len(_ints), S] int32) and `floats` ([..., len(_floats), S], the fields' float dtype).

    Subclasses set `_fields` (order of the constructor's arguments), `_floats` (those that are
    floats) and optionally `_fill` (the value of each field in an empty record, `full`; 0 for
    fields not named)."""

    _fields: ClassVar[tuple[str, ...]] = ()
    _floats: ClassVar[frozenset[str]] = frozenset()
    _fill: ClassVar[dict[str, float]] = {}
    _ints: ClassVar[tuple[str, ...]]
    _float_order: ClassVar[tuple[str, ...]]
    __slots__ = ("ints", "floats")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        unknown = set(cls._floats) - set(cls._fields)
        if unknown:
            raise TypeError(f"{cls.__name__}: float fields {sorted(unknown)} are not among its fields")
        cls._ints = tuple(f for f in cls._fields if f not in cls._floats)
        cls._float_order = tuple(f for f in cls._fields if f in cls._floats)
        for i, name in enumerate(cls._ints):
            setattr(cls, name, property(lambda self, i=i: self.ints[..., i, :]))
        for i, name in enumerate(cls._float_order):
            setattr(cls, name, property(lambda self, i=i: self.floats[..., i, :]))
        jax.tree_util.register_pytree_node(cls, lambda r: ((r.ints, r.floats), None), cls._unflatten)

    def __init__(self, *args: Any, **kwargs: Any):
        if len(args) > len(self._fields):
            raise TypeError(f"{type(self).__name__} takes {len(self._fields)} fields, got {len(args)}")
        values = dict(zip(self._fields, args, strict=False))
        twice = set(values) & set(kwargs)
        if twice:
            raise TypeError(f"{type(self).__name__}: fields given twice: {sorted(twice)}")
        values.update(kwargs)
        missing = [f for f in self._fields if f not in values]
        unknown = sorted(set(values) - set(self._fields))
        if missing or unknown:
            raise TypeError(f"{type(self).__name__}: missing fields {missing}, unknown fields {unknown}")
        floats = [values[f] for f in self._float_order]
        fdt = jnp.result_type(*floats, float)  # JAX's default float when every value is an integer
        self.ints = _stack([values[f] for f in self._ints], jnp.int32)
        self.floats = _stack(floats, fdt)

    @classmethod
    def _unflatten(cls, _aux: None, children: Any) -> Record:
        record = object.__new__(cls)
        record.ints, record.floats = children
        return record

    @classmethod
    def of(cls, ints: Any, floats: Any) -> Record:
        """The record whose packed arrays are `ints` and `floats` (any leaves: a pytree's)."""
        return cls._unflatten(None, (ints, floats))

    @classmethod
    def full(cls, shape: tuple[int, ...], float_dtype: Any) -> Record:
        """A record whose fields have `shape` (at least one axis), each holding its `_fill` value."""
        *lead, last = shape
        ints = jnp.asarray([cls._fill.get(f, 0) for f in cls._ints], jnp.int32)[:, None]
        floats = jnp.asarray([cls._fill.get(f, 0.0) for f in cls._float_order], float_dtype)[:, None]
        return cls.of(
            jnp.broadcast_to(ints, (*lead, len(cls._ints), last)),
            jnp.broadcast_to(floats, (*lead, len(cls._float_order), last)),
        )

    def _replace(self, **kwargs: Any) -> Record:
        """A copy with the named fields replaced (broadcast to the fields' shape, cast to their dtype)."""
        unknown = sorted(set(kwargs) - set(self._fields))
        if unknown:
            raise ValueError(f"{type(self).__name__} has no fields {unknown}")
        return self.of(_put(self.ints, self._ints, kwargs), _put(self.floats, self._float_order, kwargs))

    def _asdict(self) -> dict[str, Any]:
        """The fields by name, in `_fields` order."""
        return {f: getattr(self, f) for f in self._fields}

    def __iter__(self):
        return iter(getattr(self, f) for f in self._fields)

    def __repr__(self) -> str:
        shape = _shape(self.ints) if hasattr(self.ints, "shape") else "?"
        return f"{type(self).__name__}({', '.join(self._fields)}; shape {shape})"


def _put(packed: Any, names: tuple[str, ...], values: dict[str, Any]) -> Any:
    """`packed` with the rows of the fields in `values` replaced: one select whose unchanged rows
    read `packed` where they are written, so XLA updates a loop's carry in place (a concatenation
    of the kept rows and the new ones would be copied first)."""
    if not any(f in values for f in names):
        return packed
    shape = _shape(packed)
    new = _stack([values.get(f, 0) for f in names], packed.dtype, shape)
    replaced = np.array([f in values for f in names])[:, None]
    return jnp.where(replaced, new, packed)


def _shape(packed: Any) -> tuple[int, ...]:
    """The fields' shape of a packed array (without its field axis)."""
    return (*packed.shape[:-2], packed.shape[-1])


def _stack(values: list[Any], dtype: Any, shape: tuple[int, ...] | None = None) -> jax.Array:
    """The values as one array with a field axis before the last, each cast to `dtype` and
    broadcast to `shape` (default: the values' common shape, at least one axis)."""
    arrays = [jnp.asarray(v).astype(dtype) for v in values]
    if shape is None:
        shape = np.broadcast_shapes((1,), *(a.shape for a in arrays))
    if not arrays:
        return jnp.zeros((*shape[:-1], 0, shape[-1]), dtype)
    return jnp.stack([jnp.broadcast_to(a, shape) for a in arrays], axis=-2)
