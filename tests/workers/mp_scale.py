"""Multi-process worker for the scale tests, reporting what each process asked of the
coordination service and of the store (zarrckpt._util.stats).

    save DIR STEP            save the state (every process)
    restore DIR MESH [BROADCAST [MAX_INFLIGHT_BYTES]]
                             restore onto MESH ("replicated", "mixed", "sharded"), check
                             every addressable shard
    kill DIR STEP VICTIM     like save, but process VICTIM (not 0, which hosts the
                             coordination service) SIGKILLs itself mid-write

Several of them, joined by "+", run one after the other in one job (a job costs its
processes' start, several seconds of CPU on a small CI machine); the report holds what
each found, in order ("done"), and what the last found, as a one-action job reports it.
"""

from __future__ import annotations

import os
import signal

from common import check_shards, exit_job, expected, init, report

args = init()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import zarrckpt  # noqa: E402
from zarrckpt import _storage
from zarrckpt._util import stats as _stats  # noqa: E402

SHAPES = {"sharded": (64, 32), "replicated": (1024, 512), "small": (1024,), "host": (5, 3)}  # replicated: 2 MiB
TIMEOUT_S = 20.0


def global_array(name: str, sharding) -> jax.Array:
    full = expected(name, SHAPES[name])
    return jax.make_array_from_callback(full.shape, sharding, lambda index: full[index])


def state() -> dict:
    mesh = Mesh(np.array(jax.devices()), ("all",))
    return {"sharded": global_array("sharded", NamedSharding(mesh, P("all"))),
            "replicated": global_array("replicated", NamedSharding(mesh, P())),
            "small": global_array("small", NamedSharding(mesh, P("all"))),  # 4 KiB over every device
            "host": expected("host", SHAPES["host"]), "step": 7}


def save(directory: str, step: str, victim: int | None = None) -> dict:
    _stats.reset()
    if victim == jax.process_index():
        write = _storage.Location.write

        def die_mid_write(self, key, *parts, **kwargs):
            if "/c." in key:
                os.kill(os.getpid(), signal.SIGKILL)
            return write(self, key, *parts, **kwargs)

        _storage.Location.write = die_mid_write
    try:
        # A shorter wait where a process is killed: the test waits for the timeout.
        zarrckpt.save_checkpoint(directory, int(step), state(), timeout_s=TIMEOUT_S if victim is None else 8.0)
    except zarrckpt.CoordinationTimeoutError as e:
        report(error=str(e), latest=zarrckpt.latest_step(directory))
        # The job is broken: leave without JAX's shutdown barrier, which would wait for the
        # dead process; process 0, which hosts the coordination service, last (exit_job).
        exit_job(0)
    counts = _stats.snapshot()
    return {"calls": counts.get("coordination_calls", 0), "writes": counts.get("store_write", 0)}


RESTORE_MESHES = {
    # Every leaf on every device: data-parallel replicas, all of it needed on every host.
    "replicated": lambda mesh: {"sharded": P(), "replicated": P(), "small": P()},
    # Sharded within a host, replicated across hosts: (hosts, devices per host).
    "mixed": lambda mesh: {"sharded": P(None, "local"), "replicated": P("local"), "small": P()},
    "sharded": lambda mesh: {"sharded": P(("hosts", "local")), "replicated": P("hosts"), "small": P("local")},
}


def restore(directory: str, layout: str, broadcast: str = "on", max_inflight_bytes: str = str(2**31)) -> dict:
    _stats.reset()
    devices = np.array(jax.devices()).reshape(jax.process_count(), -1)
    mesh = Mesh(devices, ("hosts", "local"))
    target = {name: NamedSharding(mesh, spec) for name, spec in RESTORE_MESHES[layout](mesh).items()}
    target["host"], target["step"] = np.zeros(SHAPES["host"], np.float32), 0
    restored, step = zarrckpt.load_checkpoint_if_it_exists(directory, target, timeout_s=TIMEOUT_S,
                                                           load_and_broadcast=broadcast == "on",
                                                           max_inflight_bytes=int(max_inflight_bytes))
    checked = check_shards(restored, SHAPES)
    counts = _stats.snapshot()
    return {"step": step, "checked": checked, "step_value": restored["step"],
            "bytes_read": counts.get("store_bytes_read", 0), "relieved": counts.get("relief_bytes_read", 0),
            "reads": counts.get("store_read", 0), "calls": counts.get("coordination_calls", 0),
            "checkpoint_bytes": sum(int(np.prod(s)) * 4 for s in SHAPES.values())}


def actions(words: list[str]) -> list[list[str]]:
    out: list[list[str]] = [[]]
    for word in words:
        out.append([]) if word == "+" else out[-1].append(word)
    return out


done = []
for mode, *rest in actions(args):
    if mode == "save":
        done.append(save(*rest))
    elif mode == "kill":
        done.append(save(rest[0], rest[1], victim=int(rest[2])))
    else:
        done.append(restore(*rest))
report(**done[-1], done=done)
