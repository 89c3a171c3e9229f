"""What every test worker does first: join the job, and report a result."""

from __future__ import annotations

import json
import os
import sys

import jax
import numpy as np

# The storage_options of the store under test (multiprocess.run passes them).
STORAGE_OPTIONS = json.loads(os.environ.get("ZARRCKPT_TEST_STORAGE_OPTIONS") or "null")


def init() -> list[str]:
    """Joins the distributed job named on the command line; returns the remaining args."""
    coordinator, count, pid, *rest = sys.argv[1:]
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if int(count) > 1:
        jax.distributed.initialize(coordinator, num_processes=int(count), process_id=int(pid))
    return rest


def _channel(suffix: str) -> str:
    """This process's file for telling the test something (see tests/multiprocess.py)."""
    return os.path.join(os.environ["ZARRCKPT_TEST_CHANNEL"], f"{sys.argv[3]}.{suffix}")


def report(**result) -> None:
    """The worker's result, for the test: written aside, then renamed, so it is whole."""
    path = _channel("json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)


def say(line: str) -> None:
    """One line for a test that watches the worker as it runs: one append of the whole
    line, so a kill leaves at most a line without its end, which the reader skips."""
    fd = os.open(_channel("said"), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def expected(name: str, shape, dtype="float32") -> np.ndarray:
    """The deterministic value of leaf `name`, so every process can check its shards."""
    offset = sum(map(ord, name))
    return (np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape) + offset).astype(dtype)


def check_shards(tree: dict, shapes: dict) -> int:
    """Checks every addressable shard of every restored leaf; returns how many were checked."""
    checked = 0
    for name, shape in shapes.items():
        value = tree[name]
        full = expected(name, shape, value.dtype)
        if isinstance(value, jax.Array):
            for shard in value.addressable_shards:
                got = np.asarray(shard.data)
                if not np.array_equal(got, full[shard.index]):
                    raise AssertionError(f"leaf {name} shard {shard.index} on {shard.device} differs")
                checked += 1
        else:
            if not np.array_equal(np.asarray(value), full):
                raise AssertionError(f"leaf {name} differs")
            checked += 1
    return checked
