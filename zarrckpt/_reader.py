"""Opening a checkpoint for reading: commit check, layout detection, leaf records.

Two layouts are read: zarrckpt's own (a zarr v3 group whose `zarrckpt` attribute
records the tree), and seqax's (a zarr v2 group with one array per leaf named by
`jax.tree_util.keystr`, and the same `write_completed` commit attribute).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import re
import warnings
from typing import Any, Callable

import jax
import numpy as np
import zarr

from . import _commit, _dtypes, _naming, _tree
from ._storage import Location
from .errors import CheckpointCorruptError, CheckpointNotFoundError

_tu = jax.tree_util


@dataclasses.dataclass(frozen=True)
class StoredLeaf:
    """What a checkpoint holds for one leaf."""

    path: _tree.KeyPath
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    kind: str  # "jax", "numpy", "numpy_scalar", or the Python scalar type's name

    @property
    def where(self) -> str:
        return _tree.describe_path(self.path)


@dataclasses.dataclass
class Checkpoint:
    """An opened checkpoint: its arrays are opened lazily, data is read by the caller."""

    loc: Location
    layout: str  # "zarrckpt" or "seqax"
    committed: bool
    spec: dict[str, Any]
    leaves: dict[str, StoredLeaf]
    name_of: Callable[[_tree.KeyPath], str]  # target key path -> array name in this layout
    meta: dict[str, Any]
    group: zarr.Group

    def array(self, name: str) -> zarr.Array:
        return self.group[name]


def open_checkpoint(loc: Location, *, require_committed: bool = True) -> Checkpoint:
    """Opens the checkpoint at `loc`: one metadata read for zarrckpt's layout.

    Raises CheckpointNotFoundError if there is none, or if it is not committed and
    `require_committed`; CheckpointCorruptError if its metadata cannot be understood.
    """
    attributes = _commit.read_attributes(loc)
    if attributes is None:
        raise CheckpointNotFoundError(f"no checkpoint at {loc.url}")
    committed = _commit.state_of(attributes) is _commit.State.COMMITTED
    if require_committed and not committed:
        raise CheckpointNotFoundError(
            f"checkpoint at {loc.url} is not committed (no '{_naming.COMMIT_ATTR}: true'): "
            "it is incomplete, or still being written"
        )
    zarr_format, attrs = attributes
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # consolidated metadata is not in the v3 spec yet
        try:
            group = zarr.open_group(loc.store(read_only=True), mode="r", zarr_format=zarr_format)
        except Exception as e:
            raise CheckpointCorruptError(f"cannot open checkpoint {loc.url}: {type(e).__name__}: {e}") from e
    meta = attrs.get(_naming.META_ATTR)
    if isinstance(meta, dict):
        return _open_zarrckpt(loc, committed, meta, group)
    if zarr_format == 2:
        return _open_seqax(loc, committed, group)
    raise CheckpointCorruptError(f"{loc.url} is a zarr group but not a zarrckpt or seqax checkpoint")


def _open_zarrckpt(loc: Location, committed: bool, meta: dict[str, Any], group: zarr.Group) -> Checkpoint:
    version = meta.get("format_version")
    if not isinstance(version, int) or version > _naming.FORMAT_VERSION:
        raise CheckpointCorruptError(
            f"checkpoint {loc.url} has format_version {version!r}; this zarrckpt reads up to "
            f"{_naming.FORMAT_VERSION} (upgrade zarrckpt to read it)"
        )
    spec = meta.get("tree")
    try:
        leaves = {
            rec["name"]: StoredLeaf(path, rec["name"], tuple(int(d) for d in rec["shape"]),
                                    _dtypes.from_name(rec["dtype"]), rec["type"])
            for path, rec in _tree.recorded_leaves(spec)
        }
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointCorruptError(f"checkpoint {loc.url} has a malformed tree record: {e!r}") from e
    for leaf in leaves.values():
        if any(d < 0 for d in leaf.shape):
            raise CheckpointCorruptError(f"checkpoint {loc.url}: leaf {leaf.where} has shape {leaf.shape}")
    return Checkpoint(loc, "zarrckpt", committed, spec, leaves, _tree.name_of, meta, group)


# One key entry of jax.tree_util.keystr: ['str'] / ["str"], [int], or .attr
_KEYSTR_TOKEN = re.compile(r"""\['((?:[^'\\]|\\.)*)'\]|\["((?:[^"\\]|\\.)*)"\]|\[(-?\d+)\]|\.([A-Za-z_]\w*)""")


def _parse_keystr(name: str) -> _tree.KeyPath | None:
    path: list[Any] = []
    pos = 0
    while pos < len(name):
        m = _KEYSTR_TOKEN.match(name, pos)
        if m is None:
            return None
        single, double, index, attr = m.groups()
        if index is not None:
            path.append(_tu.SequenceKey(int(index)))
        elif attr is not None:
            path.append(_tu.GetAttrKey(attr))
        else:
            text = single if single is not None else double
            path.append(_tu.DictKey(re.sub(r"\\(.)", r"\1", text)))
        pos = m.end()
    return tuple(path)


def _open_seqax(loc: Location, committed: bool, group: zarr.Group) -> Checkpoint:
    names = sorted(group.array_keys())
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        arrays = dict(zip(names, pool.map(lambda n: group[n], names)))
    leaves = {}
    for name, array in arrays.items():
        path = _parse_keystr(name)
        if path is None:
            raise CheckpointCorruptError(f"seqax checkpoint {loc.url}: cannot parse leaf name {name!r}")
        leaves[name] = StoredLeaf(path, name, tuple(array.shape), np.dtype(array.dtype), "numpy")
    spec = _spec_from_paths(list(leaves.values()))
    return Checkpoint(loc, "seqax", committed, spec, leaves, lambda p: _tu.keystr(tuple(p)), {}, group)


def _spec_from_paths(leaves: list[StoredLeaf]) -> dict[str, Any]:
    """A tree record for seqax's layout, which keeps only leaf names: dicts and lists."""
    if len(leaves) == 1 and not leaves[0].path:
        return {"kind": "leaf", "name": leaves[0].name, "type": "numpy"}
    root: dict[Any, Any] = {}
    for leaf in leaves:
        node = root
        for entry in leaf.path[:-1]:
            node = node.setdefault(_key(entry), {})
        node[_key(leaf.path[-1])] = leaf

    def to_spec(node: Any) -> dict[str, Any]:
        if isinstance(node, StoredLeaf):
            return {"kind": "leaf", "name": node.name, "type": "numpy"}
        keys = sorted(node, key=lambda k: (isinstance(k, str), k))
        if keys and all(isinstance(k, int) for k in keys):
            return {"kind": "list", "children": [to_spec(node[k]) for k in keys]}
        return {"kind": "dict", "keys": keys, "children": [to_spec(node[k]) for k in keys]}

    return to_spec(root)


def _key(entry: Any) -> Any:
    if isinstance(entry, _tu.SequenceKey):
        return entry.idx
    return entry.name if isinstance(entry, _tu.GetAttrKey) else entry.key
