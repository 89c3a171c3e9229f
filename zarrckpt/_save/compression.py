"""Which chunks of a save with `compression=` are compressed: those whose leaf a probe
shows compresses well enough to pay for the time it takes, at the speed the store is
taking this process's writes.

An array saved with compression stores every chunk through blosc; each chunk is either
compressed or stored as it is behind blosc's header (`ChunkCodec.frame`), which any
blosc reader takes alike, so that the choice is made per chunk, on the process that
writes it, with nothing to agree on.

The choice is a cost model, measured, never assumed: writing a stored byte costs `write`
seconds (this process's writes so far, timed as they return), compressing a byte costs
`compress` seconds and leaves `ratio` of it (a probe: a sample of the leaf's first
chunk this process writes in the save, compressed on the writer's thread as the other
writers run). A chunk is compressed where `compress + ratio * write` comes to at most
`_PAYS` of `write`: so never before a write has been timed, and on a local disk, whose
writes go at the speed of memory, about never. A leaf is not even probed where the
fastest compression seen could not pay with nothing left of it.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

from .._format.chunks import MIN_COMPRESSED_BYTES, ChunkCodec

# A chunk is compressed where that is modelled to take at most this share of the time
# its write takes as it is: the margin keeps a save from paying for a model's noise.
_PAYS = 0.9
# Bytes of a leaf's first chunk that its probe compresses.
_SAMPLE_BYTES = 256 * 2**10


@dataclasses.dataclass(frozen=True)
class _Probe:
    ratio: float  # compressed size over size
    seconds_per_byte: float


class Compressor:
    """The cost model of one process's saves (see the module docstring): the write speed
    outlasts a save, so that a manager's saves start from the last one's; the probes
    last one save (`start`), as leaves change. Thread-safe: the writers share it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._probes: dict[str, _Probe] = {}
        self._fastest: float | None = None  # the fewest seconds per byte a probe took
        self._written = [0, 0.0]  # stored bytes of timed writes, and their seconds

    def start(self) -> None:
        """A new save: its leaves are probed afresh."""
        with self._lock:
            self._probes = {}

    def frame(self, name: str, codec: ChunkCodec, data: Any) -> tuple[Any, ...]:
        """The parts of the chunk of the leaf `name` holding `data` (`ChunkCodec.frame`),
        compressed where that pays."""
        payload = codec.payload(data)
        if codec.compression is None:
            return codec.frame(payload)
        write = self._write_seconds_per_byte()
        with self._lock:
            probe, fastest = self._probes.get(name), self._fastest
        if write is None or (probe is None and fastest is not None and fastest > _PAYS * write):
            return codec.frame(payload)
        compressed = None
        if probe is None:
            sample = payload[:_SAMPLE_BYTES - _SAMPLE_BYTES % codec.dtype.itemsize]
            started = time.perf_counter()
            made = codec.compress(sample)
            probe = _Probe(len(made) / max(sample.nbytes, 1), (time.perf_counter() - started) / max(sample.nbytes, 1))
            compressed = made if sample.nbytes == payload.nbytes else None
            with self._lock:
                self._probes[name] = probe
                self._fastest = min(self._fastest or probe.seconds_per_byte, probe.seconds_per_byte)
        if probe.seconds_per_byte + probe.ratio * write > _PAYS * write:
            return codec.frame(payload)
        return codec.frame(payload, compressed if compressed is not None else codec.compress(payload))

    def wrote(self, nbytes: int, seconds: float) -> None:
        """A chunk of `nbytes` stored bytes took `seconds` to write. Small chunks are
        not counted: their writes take about as long whatever their size."""
        if nbytes >= MIN_COMPRESSED_BYTES:
            with self._lock:
                self._written[0] += nbytes
                self._written[1] += seconds

    def _write_seconds_per_byte(self) -> float | None:
        with self._lock:
            nbytes, seconds = self._written
        return seconds / nbytes if nbytes else None
