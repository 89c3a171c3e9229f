"""The `zarrckpt` command in processes forked from one that has imported it already
(tests/zygote.py): a command's own work takes a tenth of a second, starting Python and
importing JAX and zarr more than a second of CPU, which the CLI tests would pay some
fifty times on each run of the suite. A command given another `command` (an installed
script) is a new process of its own.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from pathlib import Path

import zygote

ROOT = Path(__file__).parent.parent


def environment(env: dict | None = None) -> dict[str, str]:
    """The environment of a command: this process's, and `env`, with this working tree
    on the path and no fake devices."""
    environment = dict(os.environ, **(env or {}))
    environment["PYTHONPATH"] = os.pathsep.join([str(ROOT), environment.get("PYTHONPATH", "")])
    environment.pop("XLA_FLAGS", None)  # the command needs no fake devices
    environment.pop("PYTEST_CURRENT_TEST", None)  # pytest's, different at each test
    return environment


def run_together(commands: list[list[str]], *, env: dict | None = None, command: list[str] | None = None,
                 timeout: float = 120) -> list[subprocess.CompletedProcess]:
    """Runs several `zarrckpt` commands at once; returns their results in order: each
    `python -m zarrckpt` forked from a zygote, or, with another `command`, each a new
    process. Raises subprocess.TimeoutExpired, having killed them, if any still runs `timeout`
    seconds after they started."""
    full = environment(env)
    with tempfile.TemporaryDirectory(prefix="zarrckpt-cli-") as outputs:
        files = [(Path(outputs) / f"{i}.out", Path(outputs) / f"{i}.err") for i in range(len(commands))]
        if command is None:
            procs = [zygote.spawn(["-m", "zarrckpt", *args], env=full, stdout=out, stderr=err)
                     for args, (out, err) in zip(commands, files)]
        else:
            procs = []
            for args, (out, err) in zip(commands, files):
                with open(out, "w") as stdout, open(err, "w") as stderr:
                    procs.append(subprocess.Popen([*command, *args], env=full, stdin=subprocess.DEVNULL,
                                                  stdout=stdout, stderr=stderr))
        deadline = time.monotonic() + timeout
        try:
            for proc in procs:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        return [subprocess.CompletedProcess(["zarrckpt", *args], proc.returncode, out.read_text(), err.read_text())
                for args, proc, (out, err) in zip(commands, procs, files)]


def run(*args: str, env: dict | None = None, command: list[str] | None = None) -> subprocess.CompletedProcess:
    """Runs `zarrckpt ARGS...` (see `run_together`) and waits for it."""
    return run_together([list(args)], env=env, command=command)[0]
