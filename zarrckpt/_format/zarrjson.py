"""JSON: the zarr v3 metadata documents zarrckpt writes (the group's and each array's
`zarr.json`), and reading any JSON safely.

zarrckpt writes its few, fixed kinds of zarr object itself rather than through
zarr's array machinery: the metadata of every array is known in advance on every
process, so nothing needs a round trip to the store to create or open an array
(chunks are `_chunks`' business; per chunk, zarr's write path cost about 3x the raw
file write here). zarr still decides what a dtype is called and how its fill value
is spelled, and zarr reads everything back, so the tests hold this module to zarr's
own reading of it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Sequence
from typing import Any

import numpy as np
from zarr.dtype import parse_data_type

from . import chunks as _chunks, dtypes as _dtypes
from .chunks import ChunkCodec

NON_FINITE = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}  # how JSON keeps what it has no number for


def array_document(shape: Sequence[int], codec: ChunkCodec,
                   attributes: dict[str, Any] | None = None) -> dict[str, Any]:
    """The `zarr.json` of one leaf's array, whose chunks `codec` stores. Without
    `attributes`, arrays of the same shape and codec (whatever their names) share one
    document object, never to be changed: a model's many leaves of a few shapes then
    hold a few documents, not one each (10,000 documents of 11 dicts and lists each were
    most of the objects a save kept, which Python's full garbage collections scan)."""
    if attributes is None:
        return _shared_document(tuple(shape), dataclasses.replace(codec, array=""))
    return _document(shape, codec, attributes)


@functools.lru_cache(maxsize=1024)
def _shared_document(shape: tuple[int, ...], codec: ChunkCodec) -> dict[str, Any]:
    return _document(shape, codec, {})


def _document(shape: Sequence[int], codec: ChunkCodec, attributes: dict[str, Any]) -> dict[str, Any]:
    data_type, fill_value = _dtype_json(codec.dtype)
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": list(shape),
        "data_type": data_type,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(codec.shape)}},
        "chunk_key_encoding": _chunks.KEY_ENCODING,
        "fill_value": fill_value,
        "codecs": codec.codecs(),
        "attributes": attributes,
        "storage_transformers": [],
    }


@functools.cache
def _dtype_json(dtype: np.dtype) -> tuple[Any, Any]:
    """How zarr spells a dtype and its zero fill value (about 1 ms: worth caching)."""
    zdtype = parse_data_type(dtype, zarr_format=3)
    return zdtype.to_json(zarr_format=3), zdtype.to_json_scalar(_dtypes.zero(dtype), zarr_format=3)


def group_document(attributes: dict[str, Any], arrays: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The group's `zarr.json`; with `arrays`, carrying zarr's consolidated metadata."""
    doc: dict[str, Any] = {"zarr_format": 3, "node_type": "group", "attributes": attributes}
    if arrays is not None:
        doc["consolidated_metadata"] = {"kind": "inline", "must_understand": False, "metadata": arrays}
    return doc


class TooDeep(ValueError):
    """JSON nested deeper than the parser goes."""


class DuplicateKey(ValueError):
    """A JSON object naming a key twice (`key`): json keeps the last one, silently."""

    def __init__(self, key: str) -> None:
        super().__init__(f"key {key!r:.100} appears twice in one object")
        self.key = key


def decode(raw: bytes | str, *, unique_keys: bool = False) -> Any:
    """JSON text as Python values. Every JSON zarrckpt reads comes through here (metadata,
    leases, options), so anything that is not JSON is one ValueError with a one-line
    reason, nesting deeper than the parser goes (TooDeep) included. With `unique_keys`,
    an object naming a key twice is refused (DuplicateKey): where another reader may
    keep the first, the two would not read the same document."""
    try:
        return json.loads(raw, object_pairs_hook=_unique if unique_keys else None)
    except RecursionError:
        raise TooDeep("JSON nested too deeply") from None


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) < len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise DuplicateKey(key)
            seen.add(key)
    return obj


def object_or_none(raw: bytes | str) -> dict[str, Any] | None:
    """A JSON object, or None for anything else."""
    try:
        doc = decode(raw)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def encode_document(doc: dict[str, Any]) -> bytes:
    # No indent: json's C encoder only runs for compact output, ~10x faster on big trees.
    return json.dumps(doc, allow_nan=False, separators=(",", ":")).encode("utf-8")
