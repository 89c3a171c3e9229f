"""Launching real multi-process JAX jobs on localhost for the tests.

Each worker is a Python process (forked from one that has imported JAX: tests/zygote.py)
that calls `jax.distributed.initialize` with a localhost coordinator and gloo CPU
collectives, with its own fake CPU devices.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import zygote

WORKERS = Path(__file__).parent / "workers"


def free_port() -> int:
    """A port free now that nothing else of this test run will take before the job's
    coordinator binds it: below the kernel's ephemeral range, where no connection's own
    port and no `bind(0)` (the store servers') is ever put, and in a slice of its own
    for each pytest-xdist worker."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    span = (low - _FIRST_PORT) // workers
    if span < 1000:  # an ephemeral range starting low (1024-65535): no room below it, take the kernel's pick
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    first = _FIRST_PORT + worker * span
    for port in random.sample(range(first, first + span), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # another program's
            return port
    raise RuntimeError(f"no free port in {first}-{first + span - 1}")


_FIRST_PORT = 12000


def launch(worker: str, *args: str, processes: int = 2, devices: int = 4,
           storage_options: dict | None = None) -> list[subprocess.Popen]:
    """Starts tests/workers/<worker>.py in `processes` processes of one JAX job, each with
    `devices` CPU devices; their stdout and stderr go, merged, to the file `proc.output`
    (no pipe that could fill while nobody reads it). `storage_options` reach the
    worker's zarrckpt calls (workers/common.py).

    What a worker tells the test does not go through its output, which JAX and XLA
    also write to (a C++ log line once landed in the middle of a result): each
    process has files of its own, `proc.said` (lines, see `common.say`) and
    `proc.result` (see `common.report`)."""
    port = free_port()
    channel = tempfile.mkdtemp(prefix="zarrckpt-worker-")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               ZARRCKPT_TEST_STORAGE_OPTIONS=json.dumps(storage_options), ZARRCKPT_TEST_CHANNEL=channel)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent.parent), env.get("PYTHONPATH", "")])
    procs = []
    for pid in range(processes):
        output = Path(channel) / f"{pid}.out"
        proc = zygote.spawn([str(WORKERS / f"{worker}.py"), f"127.0.0.1:{port}", str(processes), str(pid), *args],
                            env=env, stdout=output)
        proc.output = output  # type: ignore[attr-defined]
        proc.said = Path(channel) / f"{pid}.said"  # type: ignore[attr-defined]
        proc.result = Path(channel) / f"{pid}.json"  # type: ignore[attr-defined]
        procs.append(proc)
    return procs


def said(proc: subprocess.Popen) -> list[str]:
    """The whole lines a launched worker has said so far (a line cut short by a kill is
    left out)."""
    try:
        text = proc.said.read_text()  # type: ignore[attr-defined]
    except FileNotFoundError:
        return []
    return text.split("\n")[:-1]


def run(worker: str, *args: str, processes: int = 2, devices: int = 4, timeout: float = 180,
        expect_ok: bool = True, storage_options: dict | None = None) -> list[dict]:
    """Runs `launch`'s processes to the end; returns each one's result (`common.report`),
    with its exit code and output. With `expect_ok` a non-zero exit fails the test
    with that process's output; a job still running after `timeout` seconds fails it
    with every process's output and stacks."""
    procs = launch(worker, *args, processes=processes, devices=devices, storage_options=storage_options)
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        # Where each one was: every thread's stack (workers/common.py), then killed.
        hung = [proc for proc in procs if proc.poll() is None]
        for proc in hung:
            proc.send_signal(signal.SIGUSR1)
        time.sleep(2)
        outputs = "\n".join(f"-- process {pid}{' (hung)' if proc in hung else ''}:\n"
                            + proc.output.read_text(errors="replace")[-20000:]  # type: ignore[attr-defined]
                            for pid, proc in enumerate(procs))
        raise AssertionError(f"{worker} did not end in {timeout:.0f} s:\n{outputs}") from None
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    results = []
    for pid, proc in enumerate(procs):
        out = proc.output.read_text(errors="replace")  # type: ignore[attr-defined]
        if expect_ok and proc.returncode != 0:
            raise AssertionError(f"{worker} process {pid} exited {proc.returncode}:\n{out}")
        reported = json.loads(proc.result.read_text()) if proc.result.exists() else {}  # type: ignore[attr-defined]
        results.append({"returncode": proc.returncode, "output": out, **reported})
    shutil.rmtree(procs[0].said.parent, ignore_errors=True)  # type: ignore[attr-defined]
    return results
