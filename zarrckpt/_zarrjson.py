"""The zarr v3 documents and chunk bytes zarrckpt writes.

zarrckpt writes its few, fixed kinds of zarr object itself rather than through
zarr's array machinery: the metadata of every array is known in advance on every
process, so nothing needs a round trip to the store to create or open an array,
and a chunk is just its bytes (the `bytes` codec, little-endian, no compression)
followed by their CRC-32C (zarr's `crc32c` codec).
Per chunk, zarr's write path cost about 3x the raw file write here. zarr still
decides what a dtype is called and how its fill value is spelled, and zarr reads
everything back, so the tests hold this module to zarr's own reading of it.
"""

from __future__ import annotations

import functools
import json
from typing import Any, Sequence

import crc32c
import numpy as np
from zarr.dtype import parse_data_type

from . import _dtypes

# zarr's "default" chunk key encoding with "." as separator: `name/c.0.1`. All of an
# array's chunks sit in its one directory, so a local save creates no directory per
# chunk row (with "/", directory creation cost a fifth of the save).
CHUNK_SEPARATOR = "."
# zarr's crc32c codec: 4 bytes after the chunk, the CRC-32C of its bytes, little-endian.
CRC32C_CODEC = {"name": "crc32c"}
CHECKSUM_BYTES = 4


def array_document(shape: Sequence[int], dtype: np.dtype, chunks: Sequence[int], *,
                   checksum: bool = True) -> dict[str, Any]:
    """The `zarr.json` of one leaf's array; `checksum` adds zarr's crc32c codec."""
    zdtype = _zarr_dtype(dtype)
    bytes_codec: dict[str, Any] = {"name": "bytes"}
    if dtype.itemsize > 1:
        bytes_codec["configuration"] = {"endian": "little"}
    codecs = [bytes_codec, CRC32C_CODEC] if checksum else [bytes_codec]
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": list(shape),
        "data_type": zdtype.to_json(zarr_format=3),
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunks)}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": CHUNK_SEPARATOR}},
        "fill_value": zdtype.to_json_scalar(_dtypes.zero(dtype), zarr_format=3),
        "codecs": codecs,
        "attributes": {},
        "storage_transformers": [],
    }


@functools.lru_cache(maxsize=None)
def _zarr_dtype(dtype: np.dtype) -> Any:
    return parse_data_type(dtype, zarr_format=3)  # about 1 ms a call: worth caching


def group_document(attributes: dict[str, Any], arrays: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The group's `zarr.json`; with `arrays`, carrying zarr's consolidated metadata."""
    doc: dict[str, Any] = {"zarr_format": 3, "node_type": "group", "attributes": attributes}
    if arrays is not None:
        doc["consolidated_metadata"] = {"kind": "inline", "must_understand": False, "metadata": arrays}
    return doc


def encode_document(doc: dict[str, Any]) -> bytes:
    # No indent: json's C encoder only runs for compact output, ~10x faster on big trees.
    return json.dumps(doc, allow_nan=False, separators=(",", ":")).encode("utf-8")


def chunk_key(name: str, coords: Sequence[int]) -> str:
    return f"{name}/" + CHUNK_SEPARATOR.join(["c", *map(str, coords)])


def encode_chunk(data: np.ndarray, chunks: Sequence[int]) -> np.ndarray:
    """A chunk's stored bytes (before any checksum): C order, little-endian, padded with
    zeros to the full chunk shape at the array's edge, as zarr's `bytes` codec stores it."""
    data = np.asarray(data)
    little = data.dtype.newbyteorder("<") if data.dtype.byteorder == ">" else data.dtype
    if tuple(data.shape) != tuple(chunks):
        padded = np.zeros(tuple(chunks), dtype=little)
        padded[tuple(slice(0, n) for n in data.shape)] = data
        data = padded
    return np.ascontiguousarray(data, dtype=little).reshape(-1).view(np.uint8)


def checksum(data: np.ndarray) -> bytes:
    """The crc32c codec's trailer for the chunk bytes `data` (a uint8 array)."""
    # crc32c (hardware CRC instructions) lets go of the GIL, so chunk writers checksum
    # on every core at once; google_crc32c holds it and cost a third of a save.
    return crc32c.crc32c(data).to_bytes(CHECKSUM_BYTES, "little")


def has_checksum(array_document: dict[str, Any]) -> bool:
    return CRC32C_CODEC in array_document.get("codecs", [])
