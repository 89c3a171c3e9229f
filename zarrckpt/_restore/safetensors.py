"""Hugging Face safetensors files, restored like a checkpoint: `load_safetensors`.

A `.safetensors` file, or a sharded set (`model.safetensors.index.json` beside its
files), opens as a `Checkpoint` whose leaves are its tensors, nested on '.', each read
in parts of whole rows, one range request each (`_format.safetensors.TensorCodec`).
Everything after that is the checkpoint's read path: matching a target, each process
reading only the parts its devices need, the byte budget, progress, sharing replicated
leaves over the device network.
"""

from __future__ import annotations

import os
from typing import Any

import jax

from .. import _concurrency, _options, _storage
from .._format import safetensors as _format
from .._format.tree import KeyPath
from .._options import LoadOptions
from .._storage import Location
from ..errors import CheckpointCorruptError, CheckpointNotFoundError
from . import checkpoint as _reader
from .load import load_opened

# The first read of a file: its header is usually inside, so one request serves it.
_FIRST_READ = 64 * 2**10


def load_safetensors(
    url: str,
    target: Any = None,
    *,
    storage_options: dict[str, Any] | None = None,
    partial: bool = False,
    allow_dtype_cast: bool = False,
    donate_target: bool = False,
    load_and_broadcast: bool = True,
    max_inflight_bytes: int = _options.DEFAULT_MAX_INFLIGHT_BYTES,
    max_workers: int | None = None,
    progress: bool | None = None,
) -> Any:
    """Restores the tensors of a Hugging Face safetensors file or sharded set.

    `url` is a `.safetensors` file, or a directory (any fsspec URL) holding a sharded
    set with its `model.safetensors.index.json`, or one `.safetensors` file. Tensor names
    nest on '.': `model.layers.0.mlp.up_proj.weight` is
    `["model"]["layers"]["0"]["mlp"]["up_proj"]["weight"]`.

    With a `target` (a pytree whose key paths, joined by '.', are the tensor names;
    leaves as for `load_pytree`: jax.Array, jax.ShapeDtypeStruct with a sharding,
    numpy arrays...), each tensor lands on its target's sharding, each process reading
    only the rows its devices need; without one, nested dicts of numpy arrays. Every
    option means what it means for `load_pytree` (collective as it is). bfloat16 and
    float8 (E4M3, E5M2) come back exactly.

    Raises:
      CheckpointNotFoundError: no safetensors file or set at `url`.
      CheckpointCorruptError: a file or index that is not what the format says (named),
        or a file cut short.
      CheckpointMismatchError: the target does not match; lists every missing and
        unexpected key path and every shape and dtype difference. Nothing was read.
      TypeError, ValueError: an option of the wrong type or value (named).
    """
    options = LoadOptions(allow_dtype_cast=allow_dtype_cast, donate_target=donate_target, partial=partial,
                          load_and_broadcast=load_and_broadcast, max_inflight_bytes=max_inflight_bytes,
                          max_workers=max_workers, progress=progress)
    return load_opened(open_safetensors(url, storage_options), target, options)


def open_safetensors(url: str, storage_options: dict[str, Any] | None = None) -> _reader.Checkpoint:
    """The safetensors file or set at `url` as a Checkpoint (see `load_safetensors`)."""
    if not isinstance(url, str) or not url:
        raise ValueError(f"url must be a non-empty string, got {url!r:.100}")
    single = url.rstrip("/").endswith(_format.EXTENSION)
    folder, _, name = url.rstrip("/").rpartition("/") if single else (url, "", "")
    loc = _storage.resolve(folder or ".", storage_options)
    listed = {e.name: e.size for e in loc.list_dir() if e.type in ("file", "link")}
    if single:
        if name not in listed:
            raise CheckpointNotFoundError(f"no safetensors file at {loc.child(name).url}")
        files: list[str] = [name]
    else:
        files = ([_format.INDEX_NAME] if _format.INDEX_NAME in listed else
                 [f for f in listed if f.endswith(_format.EXTENSION)])
    src, keys, sizes = _sources(loc, files, listed)
    weight_map = None
    if not single:
        files, weight_map = _files(loc, src, keys, list(listed))
        if weight_map is not None:
            src, keys, sizes = _sources(loc, files, listed)
    headers = _concurrency.run_all(lambda name: _header(src, keys[name], sizes[name], loc.child(name).url), files,
                                   src.concurrency)
    leaves: dict[str, _reader.StoredLeaf] = {}
    for name, tensors in zip(files, headers):
        for tensor in tensors:
            if tensor.name in leaves:
                raise CheckpointCorruptError(f"tensor {tensor.name!r} is in two files of {loc.url}")
            if weight_map is not None and weight_map.get(tensor.name, name) != name:
                raise CheckpointCorruptError(f"tensor {tensor.name!r} is in {name!r}, but the index of {loc.url} puts "
                                             f"it in {weight_map[tensor.name]!r}")
            path = tuple(jax.tree_util.DictKey(part) for part in tensor.name.split("."))
            leaves[tensor.name] = _reader.StoredLeaf(path, tensor.name, tensor.shape, tensor.dtype, "numpy",
                                                     _format.TensorCodec.of(tensor, keys[name]))
    lost = sorted(set(weight_map or ()) - set(leaves))
    if lost:
        raise CheckpointCorruptError(f"the index of {loc.url} names tensors that are in no file: "
                                     f"{', '.join(map(repr, lost[:5]))}{' ...' if len(lost) > 5 else ''}")
    try:
        spec = _format.tree_record(list(leaves))
    except _format.Malformed as e:
        raise CheckpointCorruptError(f"{loc.url} {e}") from None
    return _reader.Checkpoint(src, _format.LAYOUT, True, spec, leaves, _name_of, {})


def _sources(loc: Location, files: list[str], listed: dict[str, int]
             ) -> tuple[Location, dict[str, str], dict[str, int]]:
    """Where `files` (names in the folder `loc`) are read from, by key, and their sizes.
    On this machine's disk a file may be a link, as in a Hugging Face cache, whose
    snapshots link into its blobs: the files the user named are read where they
    really are, below their common folder. (Checkpoints never follow a link; these
    files are no checkpoint, and the user named them.)"""
    if not loc.is_local or not files:
        return loc, {f: f for f in files}, {f: listed[f] for f in files}
    real = {f: os.path.realpath(os.path.join(loc.path, f)) for f in files}
    root = os.path.commonpath([os.path.dirname(p) for p in real.values()])
    sizes = {}
    for f, p in real.items():
        try:
            sizes[f] = os.stat(p).st_size
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{loc.child(f).url} is a link to {p}, which does not exist") from None
    return _storage.resolve(root), {f: os.path.relpath(p, root) for f, p in real.items()}, sizes


def _files(loc: Location, src: Location, keys: dict[str, str], listed: list[str]
           ) -> tuple[list[str], dict[str, str] | None]:
    """The files of the set in the directory `loc` (read through `src`, by `keys`), and
    its index's weight map (None for a directory of one file)."""
    if _format.INDEX_NAME in keys:
        try:
            weight_map = _format.parse_index(src.read(keys[_format.INDEX_NAME]))
        except _format.Malformed as e:
            raise CheckpointCorruptError(f"{loc.child(_format.INDEX_NAME).url} {e}") from None
        files = sorted(set(weight_map.values()))
        if missing := [f for f in files if f not in listed]:
            raise CheckpointCorruptError(f"the index of {loc.url} names files that are not there: "
                                         f"{', '.join(map(repr, missing[:5]))}")
        return files, weight_map
    if len(keys) != 1:
        raise CheckpointNotFoundError(
            f"no safetensors file or set at {loc.url}: " + (
                f"{len(keys)} .safetensors files and no {_format.INDEX_NAME} to say how they go together"
                if keys else "no .safetensors file there"))
    return list(keys), None


def _header(loc: Location, name: str, size: int, shown: str) -> list[_format.Tensor]:
    """The tensors of the file `name` (`size` bytes, `shown` as the user named it): one
    read, two if its header is longer than the first read."""
    try:
        first = loc.read(name, limit=min(size, _FIRST_READ))
        length = _format.header_length(first, size)
        raw = first[_format.PREFIX_BYTES: _format.PREFIX_BYTES + length]
        if len(raw) < length:
            rest = bytearray(length - len(raw))
            loc.read_range(name, _format.PREFIX_BYTES + len(raw), memoryview(rest))
            raw += bytes(rest)
        return _format.parse_header(raw, size)[0]
    except _format.Malformed as e:
        raise CheckpointCorruptError(f"{shown} {e}") from None


def _name_of(path: KeyPath) -> str:
    """The tensor name a target's key path asks for: its keys joined by '.'."""
    parts = []
    for entry in path:
        if isinstance(entry, jax.tree_util.DictKey):
            parts.append(str(entry.key))
        elif isinstance(entry, jax.tree_util.SequenceKey):
            parts.append(str(entry.idx))
        elif isinstance(entry, jax.tree_util.GetAttrKey):
            parts.append(entry.name)
        else:
            parts.append(str(getattr(entry, "key", entry)))
    return ".".join(parts)
