"""Traced programs kept beside JAX's persistent compilation cache, so a later process skips tracing.

JAX's persistent cache (`burstgym.compile_cache`) keys a compiled program by the lowered program
itself, so every process still traces and lowers the Python code before it can look the
executable up: for a `prefix` episode of the rollout engine that is most of the time a second
process spends "compiling" (docs/performance.md, "Compiling"). `compile_stored` keeps the lowered
program too, exported with `jax.export` (StableHLO bytes: data, no Python code), under a
fingerprint of what the trace depends on:

- the configuration key the caller gives (dataclasses, named tuples, numbers, strings, arrays by
  their bytes; the fields that take part in `==`, as the in-process caches compare them): a key
  holding anything else (a function, an object of another kind) has no fingerprint, and its
  program is traced as usual;
- the arguments' tree, shapes and dtypes;
- the source of every module of the `burstgym` and `agents` packages and of the module defining
  each class in the key (a router's class, say); the versions of JAX, jaxlib and NumPy; JAX's
  configuration values, `XLA_FLAGS`, the compiler options and the device's platform and kind.

A later process whose fingerprint matches reads the stored program and compiles it, which JAX's
cache then answers; one whose fingerprint differs traces anew and stores its own. Not in the
fingerprint: code of other modules that a router's class calls without defining (after editing
such a module, delete the folder or set `BURSTGYM_JAX_CACHE=off`). The programs live in
`programs/` of JAX's cache folder (a file of some hundred kB each) and are kept only while that
cache is on. A stored file that cannot be read is reported (a warning naming it) and replaced.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import os
import sys
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.export
import numpy as np

from burstgym.compile_cache import COMPILER_OPTIONS, PARALLEL_OPTIONS, jit
from burstgym.record import Record

FOLDER = "programs"
FORMAT = "burstgym-program-1"
PACKAGES = ("burstgym", "agents")
# Modules whose code is known by a version in the fingerprint (or Python's own), not by their source.
VERSIONED = ("builtins", "jax", "jaxlib", "numpy", "typing", "enum", "abc", "collections")


class Unkeyable(Exception):
    """A key holds something without a fingerprint (its program is traced as usual)."""


def folder() -> Path | None:
    """Where programs are kept: `programs/` of JAX's cache folder, or None when that cache is off."""
    base = jax.config.jax_compilation_cache_dir
    return Path(base) / FOLDER if base else None


def compile_stored(
    key: Any,
    build: Callable[[], Callable],
    args: tuple,
    *,
    donate_argnums: tuple[int, ...] = (),
    parallel: bool = False,
) -> Any:
    """`compile_cache.jit(build(), donate_argnums=...)` compiled for `args`, its traced program kept
    under the fingerprint of `key` and `args` (see the module docstring): a process that finds it
    compiles it without calling `build` or tracing. Returns a compiled program called with the
    same arguments and giving the same outputs, with `as_text()` and `memory_analysis()`."""
    options = PARALLEL_OPTIONS if parallel else COMPILER_OPTIONS

    def traced() -> Any:
        return jit(build(), parallel=parallel, donate_argnums=donate_argnums).lower(*args).compile()

    where = folder()
    if where is None:
        return traced()
    try:
        digest = fingerprint(key, args, options)
    except Unkeyable:
        return traced()
    leaves, in_tree = jax.tree.flatten(args)
    path = where / f"{digest}.program"
    program = _read(path)
    if program is None:
        program = _export(build(), in_tree, leaves)
        if program is None:  # not exportable: traced as usual
            return traced()
        _write(path, *program)
    exported, out_tree = program
    firsts = np.cumsum([0] + [len(jax.tree.leaves(a)) for a in args])
    flat_donate = tuple(i for a in donate_argnums for i in range(firsts[a], firsts[a + 1]))
    compiled = jax.jit(exported.call, compiler_options=options, donate_argnums=flat_donate)
    return StoredProgram(compiled.lower(*leaves).compile(), in_tree, out_tree)


class StoredProgram:
    """A compiled stored program with the caller's argument and output trees (its flat program's
    other attributes, `as_text` and `memory_analysis` among them, are passed through)."""

    def __init__(self, compiled: Any, in_tree: Any, out_tree: Any) -> None:
        self.compiled, self.in_tree, self.out_tree = compiled, in_tree, out_tree

    def __call__(self, *args: Any) -> Any:
        leaves, tree = jax.tree.flatten(args)
        if tree != self.in_tree:
            raise TypeError(f"arguments of structure {tree} given to a program compiled for {self.in_tree}")
        return jax.tree.unflatten(self.out_tree, self.compiled(*leaves))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.compiled, name)


def fingerprint(key: Any, args: tuple, options: dict) -> str:
    """sha256 of everything the program traced from `key` and `args` depends on (the module
    docstring's list); raises `Unkeyable` for a key holding something without a fingerprint."""
    classes: set[type] = set()
    leaves, tree = jax.tree.flatten(args)
    device = jax.devices()[0]
    parts = {
        "format": FORMAT,
        "key": _canon(key, classes),
        "tree": str(tree),
        "leaves": [[list(np.shape(x)), str(x.dtype), bool(getattr(x, "weak_type", False))] for x in leaves],
        "versions": [jax.__version__, jax.lib.__version__, np.__version__],
        "config": sorted((k, repr(v)) for k, v in jax.config.values.items()),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "options": sorted(options.items()),
        "device": [device.platform, device.device_kind, jax.device_count()],
        "code": _code(classes),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _canon(x: Any, classes: set[type]) -> Any:
    """A JSON value equal for equal keys (fields that take part in `==`; arrays by their bytes)."""
    if x is None or isinstance(x, (bool, str)):
        return x
    if isinstance(x, enum.Enum):
        classes.add(type(x))
        return ["enum", _name(type(x)), x.name]
    if isinstance(x, (int, float, np.integer, np.floating)):
        return [type(x).__name__, repr(x)]
    if isinstance(x, (np.ndarray, jax.Array)):
        a = np.ascontiguousarray(np.asarray(x))
        return ["array", str(a.dtype), list(a.shape), hashlib.sha256(a.tobytes()).hexdigest()]
    if isinstance(x, type):
        classes.add(x)
        return ["class", _name(x)]
    if dataclasses.is_dataclass(x):
        classes.add(type(x))
        fields = [(f.name, _canon(getattr(x, f.name), classes)) for f in dataclasses.fields(x) if f.compare]
        return ["dataclass", _name(type(x)), fields]
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        classes.add(type(x))
        return ["namedtuple", _name(type(x)), [_canon(v, classes) for v in x]]
    if type(x) in (tuple, list, frozenset):
        items = [_canon(v, classes) for v in x]
        return [type(x).__name__, sorted(items, key=json.dumps) if type(x) is frozenset else items]
    if type(x) is dict:
        items = [[_canon(k, classes), _canon(v, classes)] for k, v in x.items()]
        return ["dict", sorted(items, key=json.dumps)]
    raise Unkeyable(type(x).__name__)


def _name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


_SOURCES: dict[Path, tuple[tuple[int, int], str]] = {}


def _code(classes: set[type]) -> list[list[str]]:
    """[path, sha256] of the packages' modules and the modules defining `classes` (JAX's, NumPy's and
    Python's own aside: their versions are in the fingerprint)."""
    files: set[Path] = set()
    for name in PACKAGES:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__file__", None):
            files.update(Path(module.__file__).parent.rglob("*.py"))
    for cls in classes:
        for base in cls.__mro__:
            module = sys.modules.get(base.__module__)
            top = base.__module__.split(".")[0]
            if top not in VERSIONED and getattr(module, "__file__", None):
                files.add(Path(module.__file__))
    return sorted([str(f), _digest(f)] for f in files)


def _digest(path: Path) -> str:
    """sha256 of a source file, read again only when its size or modification time changes."""
    stat = path.stat()
    stamp = (stat.st_size, stat.st_mtime_ns)
    known = _SOURCES.get(path)
    if known is None or known[0] != stamp:
        known = (stamp, hashlib.sha256(path.read_bytes()).hexdigest())
        _SOURCES[path] = known
    return known[1]


def _export(fn: Callable, in_tree: Any, leaves: list) -> tuple[Any, Any] | None:
    """(`jax.export.Exported` of `fn` over the flat `leaves`, `fn`'s output tree), or None when the
    program or its output tree cannot be stored (a host callback, an output of another kind)."""
    out: list = []

    def flat(*xs: Any) -> list:
        result = fn(*jax.tree.unflatten(in_tree, xs))
        flat_out, tree = jax.tree.flatten(result)
        out.append(tree)
        return flat_out

    try:
        exported = jax.export.export(jax.jit(flat))(*leaves)
    except (ValueError, NotImplementedError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        warnings.warn(
            f"burstgym: a program could not be stored ({reason}); it is traced in each process", stacklevel=3
        )
        return None
    return exported, out[0]


def _skeleton(tree: Any) -> Any:
    """A JSON description of an output tree of tuples, lists, dicts with string keys, None, named
    tuples and records (`burstgym.record`); raises `Unkeyable` for any other node."""

    def walk(x: Any) -> Any:
        if isinstance(x, _Leaf):
            return "leaf"
        if x is None:
            return None
        if isinstance(x, tuple) and hasattr(x, "_fields"):
            return {"namedtuple": _name(type(x)), "items": [walk(v) for v in x]}
        if isinstance(x, Record):
            return {"record": _name(type(x)), "items": [walk(x.ints), walk(x.floats)]}
        if type(x) in (tuple, list):
            return {type(x).__name__: [walk(v) for v in x]}
        if type(x) is dict and all(type(k) is str for k in x):
            return {"dict": [[k, walk(v)] for k, v in x.items()]}
        raise Unkeyable(type(x).__name__)

    return walk(jax.tree.unflatten(tree, [_Leaf()] * tree.num_leaves))


def _tree(skeleton: Any) -> Any:
    """The output tree a `_skeleton` describes; its named tuples must be of modules already imported."""

    def build(s: Any) -> Any:
        if s == "leaf":
            return 0
        if s is None:
            return None
        if "namedtuple" in s:
            cls = _class(s["namedtuple"])
            if not (issubclass(cls, tuple) and hasattr(cls, "_fields")):
                raise ValueError(f"{s['namedtuple']} is not a named tuple")
            return cls(*(build(v) for v in s["items"]))
        if "record" in s:
            cls = _class(s["record"])
            if not issubclass(cls, Record):
                raise ValueError(f"{s['record']} is not a record")
            return cls._unflatten(None, tuple(build(v) for v in s["items"]))
        if "tuple" in s:
            return tuple(build(v) for v in s["tuple"])
        if "list" in s:
            return [build(v) for v in s["list"]]
        return {k: build(v) for k, v in s["dict"]}

    return jax.tree.structure(build(skeleton))


def _class(name: str) -> type:
    """The class `module:qualname` of a module already imported (none is imported for it)."""
    module, qualname = name.split(":")
    cls = sys.modules[module]
    for part in qualname.split("."):
        cls = getattr(cls, part)
    if not isinstance(cls, type):
        raise ValueError(f"{name} is not a class")
    return cls


class _Leaf:
    """A leaf marker for `_skeleton`."""


def _write(path: Path, exported: Any, out_tree: Any) -> None:
    """Store a program: one line of JSON (format, output tree), then the exported bytes; written to a
    temporary file and renamed, so a reader never sees half a file."""
    try:
        header = json.dumps({"format": FORMAT, "out": _skeleton(out_tree)}).encode()
    except Unkeyable:
        return  # an output tree of another kind: traced in each process
    part = path.with_suffix(f".{os.getpid()}-{threading.get_ident()}.part")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        part.write_bytes(header + b"\n" + bytes(exported.serialize()))
        os.replace(part, path)
    except OSError as e:
        part.unlink(missing_ok=True)
        warnings.warn(
            f"burstgym: program not stored in {path.parent} ({e}); it is traced in each process", stacklevel=3
        )


def _read(path: Path) -> tuple[Any, Any] | None:
    """(exported program, output tree) stored at `path`, or None when there is none; a file that
    cannot be read is reported and treated as absent (it is replaced)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        line, _, body = data.partition(b"\n")
        header = json.loads(line)
        if header.get("format") != FORMAT:
            raise ValueError(f"format {header.get('format')!r}, expected {FORMAT!r}")
        return jax.export.deserialize(bytearray(body)), _tree(header["out"])
    except Exception as e:  # a damaged or foreign file: any error means it is not usable
        problem = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        warnings.warn(
            f"burstgym: stored program {path} could not be read ({problem}); tracing anew", stacklevel=3
        )
        return None
