"""What putting a save on stable storage costs, and which way is cheaper: a sync of each
file as it is written (and of each directory once, when the writes end), one `syncfs`
of the whole file system at the end, or zarrckpt's way where that is safe (one `syncfs`
at the end, files of 1 MiB or more synced as they are written), against no sync at all.

    python benchmarks/durability.py --dir /var/tmp     # a real disk (tmpfs syncs nothing)

Two states, each saved `--repeats` times per way, the ways interleaved round by round:
the 1 GiB tree of save_restore.py (about 200 chunks) and 10,000 leaves of 4 KiB. The
other ways run zarrckpt with its own syncs switched off or changed (a monkeypatch of
this process only); "one syncfs" then calls syncfs(2) once. Each state's saves are
deleted only once all its rounds are done: ext4 without a journal skips inodes freed
in the last minutes when it makes files, which would charge one way's deletions to
the next way's save (the 1 GiB state takes about 16 GiB of disk meanwhile).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default="/var/tmp", help="where to write: a real disk (default /var/tmp)")
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--leaves", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=3)
    _common.add_platform_arguments(parser)
    return parser.parse_args(argv)


@contextlib.contextmanager
def zarrckpt_syncs(way: str):
    """zarrckpt's own syncs: as they are, each file's alone, or none."""
    from zarrckpt._storage import local as _local

    if way == "zarrckpt":
        yield
        return
    saved = _local.os.fdatasync, _local.os.fsync, _local._syncs_whole
    _local._syncs_whole = lambda device: False
    if way != "each file":
        _local.os.fdatasync = _local.os.fsync = lambda fd: None
    try:
        yield
    finally:
        _local.os.fdatasync, _local.os.fsync, _local._syncs_whole = saved


def syncfs(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if ctypes.CDLL(None, use_errno=True).syncfs(fd) != 0:
            raise OSError(ctypes.get_errno(), "syncfs failed")
    finally:
        os.close(fd)


WAYS = ("no sync", "each file", "one syncfs", "zarrckpt")


def main() -> None:
    args = parse_args()
    _common.setup_platform(args.platform, args.devices)
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import zarrckpt

    mesh = _common.make_mesh()
    flat = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x"))
    host = np.arange(1024, dtype=np.float32)
    states = {f"{args.size_gib:g} GiB": _common.build_tree(args.size_gib, mesh),
              f"{args.leaves:,} leaves": {f"l{i:05d}": jax.make_array_from_callback((1024,), flat,
                                                                                   lambda index: host[index])
                                          for i in range(args.leaves)}}
    base = tempfile.mkdtemp(prefix="zarrckpt-durability-", dir=args.dir)
    print(f"writing to {base}; {args.repeats} rounds after a warm-up, best / median", flush=True)
    try:
        for name, state in states.items():
            times: dict[str, list[float]] = {way: [] for way in WAYS}
            for r in range(args.repeats + 1):
                for way in WAYS:
                    path = os.path.join(base, f"{r}-{way[:4]}")
                    os.sync()  # start every round with nothing dirty
                    started = time.perf_counter()
                    with zarrckpt_syncs(way):
                        zarrckpt.save_pytree(path, state)
                    if way == "one syncfs":
                        syncfs(path)
                    if r:
                        times[way].append(time.perf_counter() - started)
            for r in range(args.repeats + 1):
                for way in WAYS:
                    shutil.rmtree(os.path.join(base, f"{r}-{way[:4]}"))
            print(f"{name}: " + "; ".join(f"{way} {_common.fmt(values)}" for way, values in times.items()),
                  flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
