"""Launching real multi-process JAX jobs on localhost for the tests.

Each worker is a fresh Python process that calls `jax.distributed.initialize` with a
localhost coordinator and gloo CPU collectives, with its own fake CPU devices.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

WORKERS = Path(__file__).parent / "workers"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(worker: str, *args: str, processes: int = 2, devices: int = 4,
           storage_options: dict | None = None) -> list[subprocess.Popen]:
    """Starts tests/workers/<worker>.py in `processes` processes of one JAX job, each with
    `devices` CPU devices; their stdout and stderr come merged, as text, on `stdout`.
    `storage_options` reach the worker's zarrckpt calls (workers/common.py)."""
    port = free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               ZARRCKPT_TEST_STORAGE_OPTIONS=json.dumps(storage_options))
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent.parent), env.get("PYTHONPATH", "")])
    return [
        subprocess.Popen(
            [sys.executable, str(WORKERS / f"{worker}.py"), f"127.0.0.1:{port}", str(processes), str(pid), *args],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for pid in range(processes)
    ]


def run(worker: str, *args: str, processes: int = 2, devices: int = 4, timeout: float = 180,
        expect_ok: bool = True, storage_options: dict | None = None) -> list[dict]:
    """Runs `launch`'s processes to the end; returns each one's JSON result.

    A worker prints its result as a last line `RESULT <json>`. With `expect_ok` a
    non-zero exit fails the test with that process's output.
    """
    procs = launch(worker, *args, processes=processes, devices=devices, storage_options=storage_options)
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=timeout)
            outputs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    results = []
    for pid, (proc, out) in enumerate(zip(procs, outputs)):
        if expect_ok and proc.returncode != 0:
            raise AssertionError(f"{worker} process {pid} exited {proc.returncode}:\n{out}")
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        results.append({"returncode": proc.returncode, "output": out,
                        **(json.loads(lines[-1][len("RESULT "):]) if lines else {})})
    return results
