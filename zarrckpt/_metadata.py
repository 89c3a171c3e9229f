"""What a checkpoint holds, read from its metadata alone (no array data)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _commit, _storage
from ._format import dtypes as _dtypes, naming as _naming, tree as _tree
from ._restore import checkpoint as _reader


@dataclasses.dataclass(frozen=True)
class LeafMetadata:
    """One saved leaf: where it sits in the tree and how it is stored."""

    key_path: str  # as jax.tree_util.keystr prints it
    name: str  # the zarr array's name in the group
    shape: tuple[int, ...]
    dtype: np.dtype
    chunks: tuple[int, ...]
    kind: str  # "jax", "numpy", "numpy_scalar", "prng_key", "str", "bytes", "per_process", or a Python scalar type
    # A str or bytes leaf is stored as its bytes (uint8, UTF-8 for a str); a
    # per-process leaf as one array per process, not described here (shape ()); typed
    # PRNG keys as their key data (shape and dtype of that data).
    prng_impl: str | None = None  # typed PRNG keys: their implementation ("threefry2x32"...)

    @property
    def nbytes(self) -> int:
        return _dtypes.nbytes(self.shape, self.dtype)


@dataclasses.dataclass(frozen=True)
class CheckpointMetadata:
    """A checkpoint's description. `tree` mirrors the saved tree with a
    jax.ShapeDtypeStruct per array leaf (add shardings to it to build a restore
    target; typed PRNG keys as keys of their implementation), "" and b"" for str and
    bytes leaves, and PerProcess(None) for per-process ones."""

    url: str
    layout: str  # "zarrckpt" or "seqax"
    committed: bool
    format_version: int | None
    created_at: str | None
    leaves: tuple[LeafMetadata, ...]
    tree: Any

    @property
    def nbytes(self) -> int:
        return sum(leaf.nbytes for leaf in self.leaves)


def _placeholder(leaf: LeafMetadata) -> Any:
    """What stands for a leaf in `CheckpointMetadata.tree`: usable as its restore target."""
    if leaf.kind == "str":
        return ""
    if leaf.kind == "bytes":
        return b""
    if leaf.kind == "per_process":
        return _tree.PerProcess(None)
    if leaf.kind == "prng_key":  # keys of the saved implementation, not their raw data
        return jax.eval_shape(lambda: jax.random.wrap_key_data(jnp.zeros(leaf.shape, leaf.dtype),
                                                               impl=leaf.prng_impl))
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)


def metadata(url: str, *, storage_options: dict[str, Any] | None = None) -> CheckpointMetadata:
    """Describes the checkpoint at `url` without reading array data. Not collective.

    Args:
      url: a local path or fsspec URL of one checkpoint, committed or not.
      storage_options: passed to fsspec.

    Returns:
      A `CheckpointMetadata`; its `committed` says whether the checkpoint is committed.

    Raises:
      CheckpointNotFoundError: no checkpoint at `url`, or an uncommitted one whose
        arrays' metadata is not all there (its save still running).
      CheckpointCorruptError: its metadata cannot be understood.
    """
    ckpt = _reader.open_checkpoint(_storage.resolve(url, storage_options), require_committed=False)
    leaves = {
        name: LeafMetadata(_tree.describe_path(s.path), name, s.shape, s.dtype, s.chunks, s.kind, s.prng_impl)
        for name, s in ckpt.leaves.items()
    }
    tree = _tree.rebuild(ckpt.spec, lambda rec: _placeholder(leaves[rec["name"]]))
    return CheckpointMetadata(ckpt.loc.url, ckpt.layout, ckpt.committed, ckpt.meta.get("format_version"),
                              ckpt.meta.get("created_at"), tuple(leaves.values()), tree)


@dataclasses.dataclass(frozen=True)
class Summary:
    """What a listing shows of one checkpoint (None where it cannot be told)."""

    leaves: int | None
    nbytes: int | None
    created_at: str | None


def summarize(loc: _storage.Location, group: _commit.Group | None) -> Summary:
    """Leaf count, size and creation time of the checkpoint at `loc` whose group
    metadata is `group`: from its tree record with no further read, or, for seqax's
    layout (no tree record), from its arrays' metadata once it is committed."""
    meta = group.attributes.get(_naming.META_ATTR) if group else None
    if isinstance(meta, dict):
        try:
            records = [rec for _, rec in _tree.recorded_leaves(meta["tree"])]
            nbytes = sum(_dtypes.nbytes(rec["shape"], _dtypes.from_name(rec["dtype"])) for rec in records)
            return Summary(len(records), nbytes, meta.get("created_at"))
        except (KeyError, TypeError, ValueError, AttributeError, RecursionError):
            return Summary(None, None, meta.get("created_at"))  # `verify` says what is wrong
    if group is not None and group.state is _commit.State.COMMITTED:
        stored = _reader.open_checkpoint(loc).leaves.values()
        return Summary(len(stored), sum(leaf.nbytes for leaf in stored), None)
    return Summary(None, None, None)
