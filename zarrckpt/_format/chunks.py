"""The chunk format: one object per chunk, and everything about it in `ChunkCodec`.

A chunk object is zarr's `bytes` codec (C order, little-endian, padded with zeros to
the whole chunk shape at the array's edge, never compressed), followed in format
version 2 by zarr's `crc32c` codec (the CRC-32C of those bytes, 4 bytes,
little-endian). Its key is `<array name>/c.<i>.<j>...` (zarr's "default" chunk key
encoding with "." as separator, so all of an array's chunks share one directory).

Save, restore, verify, copy and the commit's list of checkpoint objects all go
through this module: it is the one place that knows how a chunk is stored.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import crc32c
import numpy as np

from . import dtypes as _dtypes, naming as _naming
from .._storage import Location
from ..errors import CheckpointCorruptError

SEPARATOR = "."
CRC32C_CODEC = {"name": "crc32c"}
CHECKSUM_BYTES = 4
KEY_ENCODING = {"name": "default", "configuration": {"separator": SEPARATOR}}
# A chunk's name inside its array's directory.
NAME = re.compile(r"c(\.\d+)*")
_CRC_DAMAGE = "fails its CRC-32C checksum: its bytes are damaged"

Region = tuple[tuple[int, int], ...]  # (start, stop) per axis


class DamagedChunk(CheckpointCorruptError):
    """A chunk object with the wrong size or checksum; `key` and `why` say which and how."""

    def __init__(self, key: str, url: str, why: str) -> None:
        super().__init__(f"chunk {key!r} of checkpoint {url} {why}")
        self.key, self.why = key, why


@dataclasses.dataclass(frozen=True)
class ChunkCodec:
    """How the chunks of one array are named, encoded, sized and checked."""

    array: str  # the array's name in the group: its chunks live in "<array>/"
    dtype: np.dtype
    shape: tuple[int, ...]  # the chunk shape
    checksum: bool = True

    def codecs(self) -> list[dict[str, Any]]:
        """The `codecs` entry of the array's `zarr.json`."""
        bytes_codec: dict[str, Any] = {"name": "bytes"}
        if self.dtype.itemsize > 1:
            bytes_codec["configuration"] = {"endian": "little"}
        return [bytes_codec, CRC32C_CODEC] if self.checksum else [bytes_codec]

    @property
    def data_bytes(self) -> int:
        return _dtypes.nbytes(self.shape, self.dtype)

    @property
    def stored_bytes(self) -> int:
        """The size of every stored chunk object: its data, then its checksum if any."""
        return self.data_bytes + (CHECKSUM_BYTES if self.checksum else 0)

    def coords(self, chunk: Region) -> list[int]:
        """The grid coordinates of the chunk covering `chunk` (a region on the chunk grid)."""
        return [start // size for (start, _), size in zip(chunk, self.shape)]

    def key(self, chunk: Region) -> str:
        """The object key of the chunk covering `chunk`."""
        return _naming.object_key(self.array, SEPARATOR.join(["c", *map(str, self.coords(chunk))]))

    def size_damage(self, size: int) -> str | None:
        """What is wrong with a chunk object of `size` bytes, or None. zarrckpt never
        compresses, so every chunk object has exactly `stored_bytes`."""
        return None if size == self.stored_bytes else f"has {size} bytes, expected {self.stored_bytes}"

    def encode(self, data: np.ndarray) -> tuple[Any, ...]:
        """The parts of a chunk object (written one after the other) for `data`, the
        chunk's values, which may stop short of the chunk shape at the array's edge."""
        data = np.asarray(data)
        little = data.dtype.newbyteorder("<") if data.dtype.byteorder == ">" else data.dtype
        if tuple(data.shape) != self.shape:
            padded = np.zeros(self.shape, dtype=little)
            padded[tuple(slice(0, n) for n in data.shape)] = data
            data = padded
        payload = np.ascontiguousarray(data, dtype=little).reshape(-1).view(np.uint8)
        return (payload, _crc(payload)) if self.checksum else (payload,)

    def damage(self, stored: bytes | memoryview) -> str | None:
        """What is wrong with the stored bytes of a chunk object, or None: its size, and
        with a checksum, its CRC-32C."""
        if (wrong_size := self.size_damage(len(stored))) is not None:
            return wrong_size
        if self.checksum:
            payload = np.frombuffer(stored, np.uint8, count=self.data_bytes)
            if _crc(payload) != bytes(stored[self.data_bytes:]):
                return _CRC_DAMAGE
        return None

    def load(self, loc: Location, chunk: Region, out: np.ndarray | None = None) -> np.ndarray:
        """Reads the chunk covering `chunk` from `loc` and checks it; returns its values
        in the chunk shape. With `out` (a C-contiguous array of the chunk shape), the
        bytes are read straight into it, with no copy.

        Raises FileNotFoundError if the object is absent, and DamagedChunk if its size
        or checksum is wrong.
        """
        key = self.key(chunk)
        if out is None:
            stored = loc.read(key)
            if (damage := self.damage(stored)) is not None:
                raise DamagedChunk(key, loc.url, damage)
            return np.frombuffer(stored, np.uint8, count=self.data_bytes).view(self.dtype).reshape(self.shape)
        payload = out.reshape(-1).view(np.uint8)
        trailer = bytearray(self.stored_bytes - self.data_bytes)
        size = loc.read_into(key, memoryview(payload), memoryview(trailer))
        if (wrong_size := self.size_damage(size)) is not None:
            raise DamagedChunk(key, loc.url, wrong_size)
        if self.checksum and _crc(payload) != bytes(trailer):
            raise DamagedChunk(key, loc.url, _CRC_DAMAGE)
        return out


def _crc(payload: np.ndarray) -> bytes:
    # crc32c (hardware CRC instructions) lets go of the GIL, so chunk writers checksum
    # on every core at once; google_crc32c holds it and cost a third of a save.
    return crc32c.crc32c(payload).to_bytes(CHECKSUM_BYTES, "little")
