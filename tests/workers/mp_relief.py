"""Multi-process worker for the tests of a slow process's relief (`_restore.relief`):
two processes restore replicated leaves with load and broadcast while process 1's
chunk reads are held.

    save DIR                 save the state (both processes)
    restore DIR HOLD [BYTES] restore it onto every device (max_inflight_bytes BYTES, 2 GiB
                             unless said), check every shard, report;
                             HOLD says what process 1's chunk reads do:
        none                 nothing: both fast
        stuck                each waits until the restore has returned, then fails
                             (only process 0's reads of its part can finish it)
        spare-fails          each waits until process 0's read of process 1's part
                             has failed (process 0 fails it on purpose), then reads on
        denied               each fails at once (permission denied): the restore fails
                             on both processes, and process 0 says why
        slow                 each takes 8 s; the state restored includes a complex leaf,
                             which no process reads for another (it is no integers of
                             its width): shared as always, beside the relieved ones
The other ways restore every leaf but the complex one, whose held reads nobody else
could make.
"""

from __future__ import annotations

import re
import threading
import time

from common import expected, init, report

args = init()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import zarrckpt  # noqa: E402
from zarrckpt import _storage
from zarrckpt._util import stats as _stats  # noqa: E402

# Staged (staged, half, cplx): cut over the 8 devices at chunk boundaries (then resharded
# onto every device);
# the small ones, one chunk each, are read by one process (s4-s6 by process 1: the turn
# starts at the crc32 of the name) and summed over the replicas.
SHAPES = {"staged": (64, 128), "half": (64, 16), "s0": (5, 5), "s4": (10, 3), "s5": (7,), "s6": (3, 3),
          "cplx": (64, 8)}
DTYPES = {"half": "bfloat16", "s6": "bfloat16", "cplx": "complex64"}
CHUNK = re.compile(r"/c[./]\d")
SIGNAL = "zarrckpt-test/spare-failed"  # process 0 sets it when its read for process 1 fails


def values(name: str) -> np.ndarray:
    full = expected(name, SHAPES[name], DTYPES.get(name, "float32"))
    if name in ("half", "s6"):  # bits a sum, an or or a reshard must carry exactly: -0.0, NaN payloads
        bits = full.view(np.uint16)
        bits[0, 0], bits[0, 1], bits[-1, -1] = 0x8000, 0x7FC3, 0xFF81
    return full


def state() -> dict:
    mesh = Mesh(np.array(jax.devices()), ("x",))
    return {name: jax.make_array_from_callback(shape, NamedSharding(mesh, P("x") if shape[0] % 8 == 0 else P()),
                                               lambda index, name=name: values(name)[index])
            for name, shape in SHAPES.items()}


def save(directory: str) -> None:
    # Chunks of one shard each (no merging of small shards): the sharded leaves are staged.
    zarrckpt.save_checkpoint(directory, 1, state(), timeout_s=60, min_chunk_bytes=1)
    report(saved=True)


def hold_reads(hold: str, released: threading.Event) -> None:
    """Process 1's chunk reads held as `hold` says; process 0's failing for process 1."""
    from jax._src import distributed

    client = distributed.global_state.client
    read, read_into = _storage.Location.read, _storage.Location.read_into

    def held(key: str) -> None:
        if not CHUNK.search(key):
            return
        if jax.process_index() == 1 and hold == "stuck":
            released.wait(120)
            raise OSError(f"held read of {key} let go after the restore")
        if jax.process_index() == 1 and hold == "slow":
            time.sleep(8)
        if jax.process_index() == 1 and hold == "denied":
            raise PermissionError(f"reading {key} denied on purpose")
        if jax.process_index() == 1 and hold == "spare-fails":
            client.blocking_key_value_get(SIGNAL, 120_000)
        if jax.process_index() == 0 and hold == "spare-fails" and \
                threading.current_thread().name.startswith("zarrckpt-relief"):
            client.key_value_set(SIGNAL, "1", allow_overwrite=True)
            raise OSError(f"process 0's spare read of {key} failed on purpose")

    def held_read(self, key, *a, **k):
        held(key)
        return read(self, key, *a, **k)

    def held_read_into(self, key, *a, **k):
        held(key)
        return read_into(self, key, *a, **k)

    _storage.Location.read, _storage.Location.read_into = held_read, held_read_into


def restore(directory: str, hold: str, max_inflight_bytes: str = str(2**31)) -> None:
    released = threading.Event()
    hold_reads(hold, released)
    _stats.reset()
    names = [name for name in SHAPES if name != "cplx" or hold == "slow"]
    replicated = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P())
    target = {name: jax.ShapeDtypeStruct(SHAPES[name], np.dtype(values(name).dtype), sharding=replicated)
              for name in names}
    try:
        restored = zarrckpt.load_checkpoint(directory, 1, target, max_inflight_bytes=int(max_inflight_bytes),
                                            partial=True)
    except Exception as e:
        report(error_type=type(e).__name__, error=str(e))
        return
    released.set()
    checked = 0
    for name in names:  # every addressable shard, bit for bit
        for shard in restored[name].addressable_shards:
            assert np.asarray(shard.data).tobytes() == values(name)[shard.index].tobytes(), (name, shard.index)
            checked += 1
    counts = _stats.snapshot()
    report(checked=checked, relieved=counts.get("relief_bytes_read", 0), given_up=counts.get("reads_given_up", 0))


mode, *rest = args
if mode == "save":
    save(*rest)
else:
    restore(*rest)
