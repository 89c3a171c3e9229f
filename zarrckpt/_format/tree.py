"""Pytree structure <-> the JSON tree record stored in the checkpoint.

The record keeps what `jax.tree_util` flattening throws away (None, empty containers,
key kinds), so that a checkpoint loaded without a target rebuilds nested dicts and
lists, and a target can be matched leaf by leaf by name.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import numpy as np

from .._util.regions import Region, region_of
from ..errors import CheckpointCorruptError, SourceReadError, UnsupportedLeafError
from . import dtypes as _dtypes, naming as _naming, zarrjson as _zarrjson

KeyPath = tuple[Any, ...]
# How deep a saved tree may nest. A tree record nests JSON two levels per tree level,
# and a reader parses it (and walks it, a frame per level) wherever the caller's stack
# stands, so a tree that saves must stay well inside Python's recursion limit (1000):
# deeper trees are refused at save rather than committed and unreadable later.
MAX_DEPTH = 100
PYTHON_DTYPES = {"bool": np.dtype(bool), "int": np.dtype(np.int64), "float": np.dtype(np.float64),
                 "complex": np.dtype(np.complex128)}
_tu = jax.tree_util


class _TreeCounts(Protocol):
    """What is read here of a `jax.tree_util.PyTreeDef` (jaxlib ships no stubs for it)."""

    @property
    def num_nodes(self) -> int: ...

    @property
    def num_leaves(self) -> int: ...


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One leaf of a tree: where it is, the array name it is stored under, its value."""

    path: KeyPath
    name: str
    value: Any

    @property
    def where(self) -> str:
        return describe_path(self.path)


def describe_path(path: KeyPath) -> str:
    """A key path as a user reads it in an error message, e.g. `['params']['w']`."""
    return _tu.keystr(tuple(path)) if path else "<root>"


def _component(entry: Any, path: KeyPath) -> str:
    if isinstance(entry, _tu.DictKey):
        key = entry.key
        if isinstance(key, str):
            return _naming.escape_component(key)
        if isinstance(key, int) and not isinstance(key, bool):
            return str(key)
        raise UnsupportedLeafError(
            f"dict key {key!r} of type {type(key).__name__} at {describe_path(path)}: "
            "only str and int dict keys can be saved"
        )
    if isinstance(entry, _tu.SequenceKey):
        return str(entry.idx)
    if isinstance(entry, _tu.GetAttrKey):
        return _naming.escape_component(entry.name)
    if isinstance(entry, _tu.FlattenedIndexKey):
        return str(entry.key)
    raise UnsupportedLeafError(f"key entry {entry!r} at {describe_path(path)} is of an unknown kind")


def name_of(path: KeyPath) -> str:
    """The array name of the leaf at `path` (see docs/pytree-zarr-checkpoint.md)."""
    return _naming.leaf_name([_component(e, path[: i + 1]) for i, e in enumerate(path)])


def _check_unique(leaves: Sequence[Leaf]) -> None:
    seen: dict[str, Leaf] = {}
    for leaf in leaves:
        other = seen.setdefault(leaf.name, leaf)
        if other is not leaf:
            raise UnsupportedLeafError(
                f"key paths {other.where} and {leaf.where} both map to array name {leaf.name!r}"
            )


def as_stored(leaf: Leaf) -> tuple[Leaf, dict[str, Any]]:
    """The leaf as it is stored, and what the tree record says of it.

    A typed PRNG key array is stored as its key data (uint32, one more axis) with
    the name of its implementation, so that it comes back as the same typed keys.
    """
    value = leaf.value
    if isinstance(value, jax.Array) and _dtypes.is_prng_key(value.dtype):
        data = Leaf(leaf.path, leaf.name, jax.random.key_data(value))
        return data, {**leaf_record(data), "type": "prng_key", "impl": str(jax.random.key_impl(value))}
    if isinstance(value, Deferred) and value.prng_impl is not None:
        return leaf, {**leaf_record(leaf), "impl": value.prng_impl}
    if isinstance(value, (str, bytes)):
        data = Leaf(leaf.path, leaf.name, _as_uint8(value.encode("utf-8") if isinstance(value, str) else value))
        return data, {**leaf_record(data), "type": "str" if isinstance(value, str) else "bytes"}  # numpy's too
    if isinstance(value, PerProcess):
        encoded = Leaf(leaf.path, leaf.name, Encoded.of(value.value, leaf.where))
        return encoded, {"kind": "leaf", "name": leaf.name, "type": "per_process", "shape": [], "dtype": "uint8",
                         "processes": jax.process_count()}
    return leaf, leaf_record(leaf)


@dataclasses.dataclass(frozen=True)
class PerProcess:
    """A leaf whose value differs on every process, such as a data loader's position.

    Each process saves its own `value` (JSON-able data: dicts, lists, str, numbers,
    bool, None; or a str; or bytes), and a restore into a target leaf
    `PerProcess(None)` returns `PerProcess(<this process's saved value>)`. A grain
    iterator's `get_state()` is such a value.

    Restoring with another process count than the save's is a
    CheckpointMismatchError naming the leaf, unless the target leaf says
    `strict=False`: then every process gets its target leaf back unchanged (its
    `value` as the default, e.g. `PerProcess(None, strict=False)` to start the data
    over), since positions saved for another split of the data do not carry over.
    """

    value: Any = None
    strict: bool = True


@dataclasses.dataclass(frozen=True, eq=False)
class Deferred:
    """A leaf whose values are read only as its chunks are written: an array of another
    format being imported (see `_import`), so that no process holds the whole state.

    `read` returns the values inside a box, (start, stop) per axis; `kind` is what the
    leaf was saved as ("jax", "numpy", "numpy_scalar", "prng_key" with `prng_impl`, or a
    Python scalar type's name, whose dtype `dtype` must be). `chunks` is the source's
    own chunk shape, if it has one: a chunk written is then a part of one of them, so
    that none is read twice. Indexing it with a tuple of slices reads, as indexing a
    numpy array would."""

    shape: tuple[int, ...]
    dtype: np.dtype
    read: Callable[[Region], np.ndarray]
    kind: str = "numpy"
    prng_impl: str | None = None
    chunks: tuple[int, ...] | None = None

    def __getitem__(self, take: tuple[slice, ...]) -> np.ndarray:
        return self.values(region_of(take, self.shape))

    def values(self, box: Region) -> np.ndarray:
        """The values inside `box`, read from the source. A read that fails is the
        source's failure, never a write's: damage a CheckpointCorruptError, a store's
        failure (an OSError) a SourceReadError, public types that a save raises as they
        are (see `_multihost.Agreement`), their messages with the reader's notes (the
        leaf it was reading)."""
        try:
            return self.read(box)
        except CheckpointCorruptError as e:  # its subclasses are private to the readers
            raise CheckpointCorruptError(_with_notes(e)) from e
        except OSError as e:
            raise SourceReadError(_with_notes(e)) from e


def _with_notes(e: BaseException) -> str:
    return "; ".join([str(e), *getattr(e, "__notes__", ())])


@dataclasses.dataclass(frozen=True)
class Encoded:
    """A per-process value as this process stores it: its encoding ("json", "str" or
    "bytes") and its bytes."""

    encoding: str
    data: np.ndarray  # uint8

    @classmethod
    def of(cls, value: Any, where: str) -> Encoded:
        """Raises UnsupportedLeafError, naming the leaf, for a value that is none of them."""
        if isinstance(value, bytes):
            return cls("bytes", _as_uint8(value))
        if isinstance(value, str):
            return cls("str", _as_uint8(value.encode("utf-8")))
        try:
            text = json.dumps(value, allow_nan=False, separators=(",", ":"))
        except (TypeError, ValueError, RecursionError) as e:
            raise UnsupportedLeafError(f"PerProcess leaf {where}: its value must be JSON-able data, a str or "
                                       f"bytes ({e})") from None
        return cls("json", _as_uint8(text.encode("utf-8")))

    @staticmethod
    def decode(encoding: str, data: bytes) -> Any:
        """The value `of` encoded; ValueError for an encoding it does not write."""
        if encoding == "bytes":
            return data
        if encoding == "str":
            return data.decode("utf-8")
        if encoding == "json":
            return _zarrjson.decode(data)
        raise ValueError(f"unknown per-process encoding {encoding!r}")


def _as_uint8(data: bytes) -> np.ndarray:
    return np.frombuffer(data, np.uint8)


def leaf_record(leaf: Leaf) -> dict[str, Any]:
    """What the tree record says of a saved leaf: its kind, shape and dtype."""
    value = leaf.value
    if isinstance(value, Deferred):
        kind = value.kind
    elif isinstance(value, jax.Array):
        kind = "jax"
    elif isinstance(value, np.ndarray):
        kind = "numpy"
    elif isinstance(value, np.generic):
        kind = "numpy_scalar"
    elif isinstance(value, (bool, int, float, complex)):  # an IntEnum member saves as the int it is
        kind = next(t.__name__ for t in (bool, int, float, complex) if isinstance(value, t))
    else:
        hint = ""
        if callable(value) or type(value).__module__.split(".")[0] == "equinox":
            hint = ("; a model's tree holds functions and settings beside its arrays: save its arrays alone, "
                    "e.g. eqx.filter(model, eqx.is_array) with equinox (nnx.state(model) with flax NNX), and "
                    "restore into the same filter of a fresh model")
        raise UnsupportedLeafError(
            f"leaf {leaf.where} is a {type(value).__module__}.{type(value).__qualname__}; "
            "only jax.Array, numpy arrays and scalars, Python bool/int/float/complex, str, bytes and "
            f"zarrckpt.PerProcess can be saved{hint}"
        )
    if kind == "int" and isinstance(value, int) and not _fits_int64(value):
        raise UnsupportedLeafError(f"leaf {leaf.where}: Python int {value} does not fit in int64")
    try:
        dtype = _dtypes.check_savable(PYTHON_DTYPES[kind] if kind in PYTHON_DTYPES else value.dtype)
    except TypeError as e:
        raise UnsupportedLeafError(f"leaf {leaf.where}: {e}") from None
    return {"kind": "leaf", "name": leaf.name, "type": kind,
            "shape": list(np.shape(value)), "dtype": _dtypes.dtype_name(dtype)}


def _fits_int64(value: int) -> bool:
    return -(2**63) <= value < 2**63


def signature(value: Any) -> tuple[Any, ...] | None:
    """All that `as_stored` and a save's plan read of a leaf stored as it is (a jax or
    numpy array, a numpy scalar, a Python number that fits): leaves of equal signatures
    have equal records and plans. None for a leaf stored as something else (a str or
    bytes, numpy's included, a `PerProcess`, a `Deferred`), or that cannot be saved."""
    if isinstance(value, (str, bytes, PerProcess, Deferred)):
        return None
    if isinstance(value, jax.Array):
        return (jax.Array, value.shape, value.dtype, value.sharding, value.is_fully_addressable)
    if isinstance(value, (np.ndarray, np.generic)):
        return (type(value), value.shape, value.dtype)
    kind = type(value)
    if kind is int:
        return (int,) if _fits_int64(value) else None
    return (kind,) if kind in (bool, float, complex) else None


def record(tree: Any) -> tuple[dict[str, Any], list[Leaf]]:
    """The JSON tree record of `tree` and its leaves in jax's flattening order.

    Raises UnsupportedLeafError naming the key path of the first leaf or key that
    cannot be saved, or of two key paths whose names would collide.
    """
    leaves: list[Leaf] = []
    spec = _record_node(tree, (), leaves)
    _check_unique(leaves)
    return spec, leaves


# The recursions below are module functions, not closures: a recursive closure is a
# reference cycle, which would keep the leaves it collects (the caller's arrays) alive
# until the garbage collector runs.
def _record_node(node: Any, path: KeyPath, leaves: list[Leaf], components: tuple[str, ...] = ()) -> dict[str, Any]:
    """`components`: the escaped name components of `path` (see `name_of`), built as
    the recursion goes down rather than again for every leaf."""
    if node is None:
        return {"kind": "none"}
    if len(path) > MAX_DEPTH:
        raise _too_deep(path)
    try:
        treedef: _TreeCounts = _tu.tree_structure(node)
    except ValueError as e:  # e.g. dict keys of mixed types, which jax cannot sort
        raise UnsupportedLeafError(f"cannot flatten the tree at {describe_path(path)}: {e}") from None
    except (RecursionError, SystemError) as e:  # jax's flatten ran out of stack (SystemError from C++)
        if not isinstance(e, RecursionError) and not isinstance(e.__cause__, RecursionError):
            raise
        raise _too_deep(path) from None
    if treedef.num_nodes == 1 and treedef.num_leaves == 1:
        leaf, leaf_spec = as_stored(Leaf(path, _naming.leaf_name(components), node))
        leaves.append(leaf)
        return leaf_spec
    # Flatten one level only: every child counts as a leaf here.
    children, _ = _tu.tree_flatten_with_path(node, is_leaf=lambda c: c is not node)
    entries = []
    for (entry, *_), child in children:
        below = path + (entry,)
        entries.append((entry, _record_node(child, below, leaves, components + (_component(entry, below),))))
    nodes = [n for _, n in entries]
    if type(node) in (list, tuple):
        return {"kind": type(node).__name__, "children": nodes}
    if isinstance(node, dict):
        return {"kind": "dict", "keys": [e.key for e, _ in entries], "children": nodes}
    return {"kind": "node", "type": f"{type(node).__module__}.{type(node).__qualname__}",
            "keys": [_entry_json(e) for e, _ in entries], "children": nodes}


def _too_deep(path: KeyPath) -> UnsupportedLeafError:
    shown = describe_path(path[:8]) + ("..." if len(path) > 8 else "")
    return UnsupportedLeafError(f"the tree below {shown} nests deeper than {MAX_DEPTH} levels, the most zarrckpt "
                                "saves (so that any reader can load it): flatten part of it, or save a subtree")


def _entry_json(entry: Any) -> Any:
    if isinstance(entry, _tu.GetAttrKey):
        return entry.name
    if isinstance(entry, _tu.DictKey):
        return entry.key
    return entry.idx if isinstance(entry, _tu.SequenceKey) else entry.key


def _entry_from_json(kind: str, key: Any) -> Any:
    """A key entry read from a tree record; ValueError for one `record` cannot write."""
    integer = isinstance(key, int) and not isinstance(key, bool)
    if kind == "dict" and (integer or isinstance(key, str)):
        return _tu.DictKey(key)
    if kind in ("list", "tuple") and integer:
        return _tu.SequenceKey(key)
    if kind == "node" and (integer or isinstance(key, str)):
        return _tu.GetAttrKey(key) if isinstance(key, str) else _tu.FlattenedIndexKey(key)
    raise ValueError(f"key {key!r} of a {kind!r} node")


_NODE_KINDS = frozenset({"leaf", "none", "list", "tuple", "dict", "node"})
# The fields `record` writes in each kind of node but a leaf (whose fields its reader checks).
_NODE_FIELDS = {"none": {"kind"}, "list": {"kind", "children"}, "tuple": {"kind", "children"},
                "dict": {"kind", "keys", "children"}, "node": {"kind", "type", "keys", "children"}}


def recorded_leaves(spec: dict[str, Any]) -> list[tuple[KeyPath, dict[str, Any]]]:
    """The leaf records of a tree record with their key paths, in flattening order.
    Raises ValueError (or TypeError...) for a record `record` could not have written."""
    out: list[tuple[KeyPath, dict[str, Any]]] = []
    _collect_records(spec, (), out)
    return out


def _collect_records(node: dict[str, Any], path: KeyPath, out: list[tuple[KeyPath, dict[str, Any]]]) -> None:
    if node["kind"] not in _NODE_KINDS:
        raise ValueError(f"node of unknown kind {node['kind']!r} at {describe_path(path)}")
    if node["kind"] != "leaf" and set(node) != _NODE_FIELDS[node["kind"]]:
        # A leaf's record turned into another kind of node would restore as a None or an
        # empty container, not as the values saved.
        raise ValueError(f"a {node['kind']!r} node at {describe_path(path)} with the fields {sorted(node)}")
    if node["kind"] == "leaf":
        out.append((path, node))
    for key, child in _keyed_children(node):
        _collect_records(child, path + (_entry_from_json(node["kind"], key),), out)


def _keyed_children(node: dict[str, Any]) -> list[tuple[Any, dict[str, Any]]]:
    children = node.get("children", [])
    keys = node.get("keys") if node["kind"] in ("dict", "node") else list(range(len(children)))
    if not isinstance(children, list) or not isinstance(keys, list) or len(keys) != len(children):
        raise ValueError(f"a {node['kind']!r} node with keys {keys!r} for {len(children)} children")
    return list(zip(keys, children))


def rebuild(spec: dict[str, Any], value_of: Callable[[dict[str, Any]], Any]) -> Any:
    """Builds nested dicts/lists/tuples from a tree record; `value_of` makes each leaf.

    Custom nodes (dataclasses, namedtuples, flax structs) come back as dicts keyed by
    field name: loading never imports or runs code named by a checkpoint.
    """
    kind = spec["kind"]
    if kind == "leaf":
        return value_of(spec)
    if kind == "none":
        return None
    items = [(key, rebuild(child, value_of)) for key, child in _keyed_children(spec)]
    if kind == "list":
        return [v for _, v in items]
    if kind == "tuple":
        return tuple(v for _, v in items)
    return dict(items)
