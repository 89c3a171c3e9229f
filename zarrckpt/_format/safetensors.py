"""Hugging Face's safetensors format, read as untrusted input (pure: bytes in, checked
descriptions out).

A `.safetensors` file is an 8-byte little-endian header length N, N bytes of JSON
(`{name: {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, ...,
"__metadata__": {str: str}}`), then the tensors' bytes, each C-order little-endian at
`8 + N + begin`. A sharded set has `model.safetensors.index.json` beside its files:
`{"metadata": {...}, "weight_map": {name: file name}}`. Tensor names nest on '.'
(`model.layers.0.mlp.up_proj.weight`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import ml_dtypes
import numpy as np

from .._regions import Region
from . import zarrjson as _zarrjson

LAYOUT = "safetensors"  # a Checkpoint's `layout` when it is a safetensors file or set
PREFIX_BYTES = 8
# More header than any real file has (a few hundred bytes per tensor): a larger
# length is damage, or a file that would make a reader allocate without bound.
MAX_HEADER_BYTES = 100 * 2**20
INDEX_NAME = "model.safetensors.index.json"
EXTENSION = ".safetensors"
DTYPES = {
    "BOOL": np.dtype(np.bool_), "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8), "U16": np.dtype(np.uint16),
    "I16": np.dtype(np.int16), "U32": np.dtype(np.uint32), "I32": np.dtype(np.int32), "U64": np.dtype(np.uint64),
    "I64": np.dtype(np.int64), "F16": np.dtype(np.float16), "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64), "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}


class Malformed(ValueError):
    """What is wrong with a file or index (its message); the reader names the file."""


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One tensor of a file: its name, dtype and shape, and where its bytes are in the
    file (`start`, from the file's first byte)."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


# Tensors are read in parts of whole rows of at most this size, one range request
# each. A part is a power of two of rows, so that it ends where a shard of a tensor of
# 2**k rows cut over 2**j devices does, and a process reads only its devices' rows; a
# shard boundary inside a part costs at most that part again.
PART_BYTES = 4 * 2**20


@dataclasses.dataclass(frozen=True)
class TensorCodec:
    """How a tensor's parts are read: one range of its file each. A part is `shape`
    (whole rows of the tensor; the tensor's shape for a 0-d one), and the read path
    treats parts as it treats a checkpoint's chunks."""

    checksum: ClassVar[bool] = False
    reads_into: ClassVar[bool] = True

    array: str  # the tensor's name
    file: str  # the key of the file holding it, beside the others of its set
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int  # of the tensor's bytes in the file
    rows: int  # of the tensor (1 for a 0-d one)

    @classmethod
    def of(cls, tensor: Tensor, file: str) -> TensorCodec:
        if not tensor.shape:
            return cls(tensor.name, file, tensor.dtype, (), tensor.start, 1)
        rows = tensor.shape[0]
        row_bytes = max(1, math.prod(tensor.shape[1:]) * tensor.dtype.itemsize)
        part = (min(rows, 1 << max(0, (PART_BYTES // row_bytes).bit_length() - 1)), *tensor.shape[1:])
        return cls(tensor.name, file, tensor.dtype, part, tensor.start, rows)

    @property
    def data_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def key(self, chunk: Region) -> str:
        return self.file

    def span(self, chunk: Region) -> tuple[int, int]:
        """Where the part covering `chunk` is in the file: its first byte, and its size
        (a tensor's last part may hold fewer rows)."""
        if not self.shape:
            return self.start, self.data_bytes
        per_row = self.data_bytes // self.shape[0]
        first = chunk[0][0] // self.shape[0] * self.shape[0]
        return self.start + first * per_row, (min(first + self.shape[0], self.rows) - first) * per_row


def header_length(prefix: bytes, file_size: int) -> int:
    """The JSON header's length, from the file's first 8 bytes; Malformed if it cannot
    be one of a file of `file_size` bytes."""
    if len(prefix) < PREFIX_BYTES:
        raise Malformed(f"is {file_size} bytes long, too short for a safetensors file")
    length = int.from_bytes(prefix[:PREFIX_BYTES], "little")
    if not 2 <= length <= min(MAX_HEADER_BYTES, file_size - PREFIX_BYTES):
        raise Malformed(f"declares a header of {length:,} bytes in a file of {file_size:,}: not a safetensors file")
    return length


def parse_header(raw: bytes, file_size: int) -> tuple[list[Tensor], dict[str, str]]:
    """The tensors a header describes, in file order, and its `__metadata__`;
    Malformed naming the first thing that is not as the format says."""
    try:
        header = _zarrjson.decode(raw)
    except ValueError as e:
        raise Malformed(f"has a header that is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise Malformed("has a header that is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise Malformed(f"has __metadata__ {metadata!r:.100}, not a map of strings")
    data = file_size - PREFIX_BYTES - len(raw)
    tensors = [_tensor(name, entry, PREFIX_BYTES + len(raw), data) for name, entry in header.items()]
    return sorted(tensors, key=lambda t: t.start), metadata


def _tensor(name: str, entry: Any, base: int, data: int) -> Tensor:
    if not name or not isinstance(entry, dict):
        raise Malformed(f"has a tensor {name!r:.100} described by {entry!r:.100}")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")  # type: Any, Any, Any
    if dtype not in DTYPES:
        raise Malformed(f"has tensor {name!r} of dtype {dtype!r:.40}, which zarrckpt does not read (it reads "
                        f"{', '.join(DTYPES)})")
    if not _ints(shape) or not _ints(offsets) or len(offsets) != 2:
        raise Malformed(f"has tensor {name!r} of shape {shape!r:.100} at {offsets!r:.100}")
    tensor = Tensor(name, DTYPES[dtype], tuple(shape), base + offsets[0])
    if not 0 <= offsets[0] <= offsets[1] <= data or offsets[1] - offsets[0] != tensor.nbytes:
        raise Malformed(f"has tensor {name!r} of {tensor.nbytes:,} bytes ({dtype} {list(shape)}) at bytes "
                        f"{offsets} of a data section of {data:,}")
    return tensor


def _ints(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in value)


def parse_index(raw: bytes) -> dict[str, str]:
    """The file holding each tensor, from a sharded set's index; Malformed if it is not
    one, or names a file anywhere but beside it."""
    try:
        index = _zarrjson.decode(raw)
    except ValueError as e:
        raise Malformed(f"is not JSON ({e})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise Malformed("has no weight_map of tensor names to files")
    for name, file in weight_map.items():
        if not isinstance(file, str) or not file.endswith(EXTENSION) or "/" in file or "\\" in file \
                or file.startswith("."):
            raise Malformed(f"maps tensor {name!r:.100} to {file!r:.100}, not a .safetensors file beside it")
    return weight_map


def tree_record(names: list[str]) -> dict[str, Any]:
    """The tree record (see `tree`) of tensors named `names`, nested on '.'; each leaf's
    array name is its tensor's name. Malformed if one name is a prefix of another's
    path (`a.b` and `a.b.c`), which no tree can hold."""
    root: dict[str, Any] = {}
    for name in names:
        node, parts = root, name.split(".")
        for i, part in enumerate(parts):
            if not part:
                raise Malformed(f"has tensor {name!r}, with an empty part between dots")
            last = i == len(parts) - 1
            found = node.get(part)
            if isinstance(found, str) or (found is not None and last):
                other = found if isinstance(found, str) else f"{'.'.join(parts)}.*"
                raise Malformed(f"has tensors {other!r} and {name!r}: one is inside the other")
            node = node.setdefault(part, name if last else {})
    return _record(root)


def _record(node: dict[str, Any]) -> dict[str, Any]:
    keys = sorted(node)
    return {"kind": "dict", "keys": keys,
            "children": [{"kind": "leaf", "name": node[k]} if isinstance(node[k], str) else _record(node[k])
                         for k in keys]}
