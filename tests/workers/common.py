"""What every test worker does first: join the job, and report a result; and how a
worker leaves a job that may be broken (`exit_job`)."""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import sys
import time
from typing import NoReturn

import jax
import numpy as np

# A job that hangs: multiprocess.run asks each process where its threads are.
faulthandler.register(signal.SIGUSR1, all_threads=True)

# The storage_options of the store under test (multiprocess.run passes them).
STORAGE_OPTIONS = json.loads(os.environ.get("ZARRCKPT_TEST_STORAGE_OPTIONS") or "null")


def init() -> list[str]:
    """Joins the distributed job named on the command line; returns the remaining args."""
    coordinator, count, pid, *rest = sys.argv[1:]
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # Before joining: once `initialize` returns on any process, every process of the job
    # has joined, so process 0 finds every other's pid file when it leaves (`exit_job`).
    _write_atomically(_channel("pid"), f"{os.getpid()} {_start_time(os.getpid())}")
    if int(count) > 1:
        jax.distributed.initialize(coordinator, num_processes=int(count), process_id=int(pid))
    return rest


def _channel(suffix: str) -> str:
    """This process's file for telling the test something (see tests/multiprocess.py)."""
    return os.path.join(os.environ["ZARRCKPT_TEST_CHANNEL"], f"{sys.argv[3]}.{suffix}")


def _write_atomically(path: str, text: str) -> None:
    """Written aside, then renamed, so a reader sees all of it or nothing."""
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def report(**result) -> None:
    """The worker's result, for the test: written aside, then renamed, so it is whole."""
    _write_atomically(_channel("json"), json.dumps(result))


def _start_time(pid: int) -> str | None:
    """When process `pid` started (field 22 of /proc/<pid>/stat, which with the pid names
    one process even if the pid is reused); None once it has exited: gone, or a zombie
    (a SIGKILLed peer stays one until the test reaps it, which it may do only after
    process 0 has exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ", which may hold spaces
    return None if fields[0] in ("Z", "X", "x") else fields[19]  # fields[0] is field 3, the state


# Process 0 waits this long at most for the others to exit (a hung one is the test's
# timeout to find, not a reason to hang process 0 too).
EXIT_WAIT_S = 60.0


def exit_job(code: int = 0) -> NoReturn:
    """Leaves a multi-process job that may be broken (a peer killed), with exit code `code`,
    as a scheduler tears such a job down: os._exit, without JAX's shutdown barrier, which
    would wait for the dead peer (300 s) and then fail.

    Process 0 hosts the coordination service, and the coordination client of every other
    live process aborts that process (SIGABRT, exit -6) as soon as it notices the service
    is gone. So the processes other than 0 leave at once, waiting for nothing, and process
    0 leaves only once each of them has exited (gone, or a zombie: a killed peer stays one
    until the test reaps it), or after EXIT_WAIT_S. A process other than 0 has already
    reported everything when it calls this, and from here to its os._exit nothing can
    abort it: the service outlives it. (Only a process 0 that dies, or is killed, before
    getting here can still take the others down; a test must not pick it as the victim.)"""
    sys.stdout.flush()
    sys.stderr.flush()
    me, count = int(sys.argv[3]), int(sys.argv[2])
    if me == 0:
        deadline = time.monotonic() + EXIT_WAIT_S
        for other in range(1, count):
            try:
                with open(os.path.join(os.environ["ZARRCKPT_TEST_CHANNEL"], f"{other}.pid")) as f:
                    pid, started = f.read().split()
            except FileNotFoundError:  # it never joined: then neither did this process
                continue
            while _start_time(int(pid)) == started and time.monotonic() < deadline:
                time.sleep(0.02)
    os._exit(code)


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


def distinct_values(leaf: int, step: int, attempt: int, shape) -> np.ndarray:
    """Every element of every leaf its own value, and other values at each step and at
    each attempt at a step (leaf < 8, attempt < 16): a chunk read from the wrong place,
    or left behind by another attempt at the same step, shows. uint32 (x64 is off),
    so with 2**18 elements values repeat every 128 steps."""
    assert 0 <= leaf < 8 and 0 <= attempt < 16, (leaf, attempt)
    count = int(np.prod(shape))
    first = ((step * 16 + attempt) * 8 + leaf) * count
    return ((np.arange(count, dtype=np.uint64) + first) % 2**32).astype(np.uint32).reshape(shape)


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


class Said(logging.Handler):
    """zarrckpt's log lines (INFO and up) on this process, from when it is made."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        logging.getLogger("zarrckpt").addHandler(self)
        logging.getLogger("zarrckpt").setLevel(logging.INFO)

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def restore_target(state: dict) -> dict:
    """A restore target for `state`: its arrays' shardings, its other leaves as they are."""
    return jax.tree_util.tree_map(lambda x: x.sharding if isinstance(x, jax.Array) else x, state)
