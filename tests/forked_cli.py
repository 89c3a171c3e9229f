"""The `zarrckpt` command in processes forked from one that has imported it already.

A command's own work takes a tenth of a second; starting Python and importing JAX and
zarr, more than a second of CPU, which the CLI tests paid some fifty times on each run
of the suite. Here one process per test worker (the zygote) imports zarrckpt once;
each command is a child forked from it that runs `python -m zarrckpt ARGS` as Python
would (`runpy`, `sys.argv`, its own stdout and stderr, stdin at /dev/null, the normal
interpreter exit with its atexit handlers), and its exit status is the command's.

A forked child has the environment its zygote imported zarrckpt in (fsspec and JAX
read theirs then): commands given other environment variables get a zygote of their
own, started in that environment. One given another `command` (an installed script)
is a new process of its own.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).parent.parent

# Runs in the zygote: the requests come on stdin, a line of JSON each (commands run at
# once, with their output files); the reply, a line of exit statuses, on stdout.
_ZYGOTE = r"""
import json, os, signal, sys, tempfile, time

# What the import prints (a warning, say) is every command's output, as it would be.
replies_fd, errors_fd = os.dup(1), os.dup(2)
printed = [tempfile.TemporaryFile(), tempfile.TemporaryFile()]
os.dup2(printed[0].fileno(), 1)
os.dup2(printed[1].fileno(), 2)
import zarrckpt._cli  # noqa: F401  (everything a command imports, once)
sys.stdout.flush()
sys.stderr.flush()
os.dup2(replies_fd, 1)
os.dup2(errors_fd, 2)
printed = [(f.seek(0), f.read())[1] for f in printed]

tasks = os.listdir("/proc/self/task")
if len(tasks) != 1:  # a fork copies one thread only: another's locks would stay held in the child
    sys.exit(f"the zygote runs {len(tasks)} threads")
requests, replies = sys.stdin.buffer, sys.stdout
while line := requests.readline():
    batch = json.loads(line)
    pids = []
    for command in batch["commands"]:
        pid = os.fork()
        if pid == 0:  # the command: falls out of this loop into Python's own exit
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            for fd, path, before in ((1, command["stdout"], printed[0]), (2, command["stderr"], printed[1])):
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
                os.write(fd, before)
            os.environ.clear()
            os.environ.update(batch["env"])
            sys.argv = ["zarrckpt", *command["args"]]
            import runpy
            runpy.run_module("zarrckpt", run_name="__main__", alter_sys=True)
            sys.exit(0)  # never on into the loop: a child must not fork commands of its own
        pids.append(pid)
    deadline, codes = time.monotonic() + batch["timeout"], {}
    while len(codes) < len(pids):
        for pid in pids:
            if pid not in codes and (done := os.waitpid(pid, os.WNOHANG))[0]:
                codes[pid] = os.waitstatus_to_exitcode(done[1])
        if time.monotonic() > deadline:
            for pid in set(pids) - set(codes):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.005)
    replies.write(json.dumps([codes[pid] for pid in pids]) + "\n")
    replies.flush()
"""


class _Zygote:
    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self._proc = subprocess.Popen([sys.executable, "-c", _ZYGOTE], env={**env, "OPENBLAS_NUM_THREADS": "1"},
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def run(self, commands: list[list[str]], outputs: Path, timeout: float) -> list[subprocess.CompletedProcess]:
        files = [(outputs / f"{i}.out", outputs / f"{i}.err") for i in range(len(commands))]
        request = {"env": self.env, "timeout": timeout,
                   "commands": [{"args": args, "stdout": str(out), "stderr": str(err)}
                                for args, (out, err) in zip(commands, files)]}
        assert self._proc.stdin is not None and self._proc.stdout is not None
        try:
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
            reply = self._proc.stdout.readline()
        except BaseException:  # its reply unread: it must answer no later request
            self._proc.kill()
            raise
        if not reply:
            raise RuntimeError(f"the zygote of the CLI tests exited {self._proc.wait()}")
        return [subprocess.CompletedProcess(["zarrckpt", *args], code, out.read_text(), err.read_text())
                for args, code, (out, err) in zip(commands, json.loads(reply), files)]

    def alive(self) -> bool:
        return self._proc.poll() is None

    def close(self) -> None:
        if self._proc.poll() is None:
            assert self._proc.stdin is not None
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


# By environment: this process's, and the last other one asked for.
_zygotes: dict[str, _Zygote] = {}
_lock = threading.Lock()


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
    forked from the zygote of this environment and `env` (`python -m zarrckpt`), or,
    with another `command`, each a new process."""
    full = environment(env)
    if command is None:
        with _lock, tempfile.TemporaryDirectory(prefix="zarrckpt-cli-") as outputs:
            key, own = json.dumps(full, sort_keys=True), json.dumps(environment(), sort_keys=True)
            if key in _zygotes and not _zygotes[key].alive():
                _zygotes.pop(key).close()
            if key not in _zygotes:
                for other in [k for k in _zygotes if k != own]:
                    _zygotes.pop(other).close()
                _zygotes[key] = _Zygote(full)
            return _zygotes[key].run(commands, Path(outputs), timeout)
    procs = [subprocess.Popen([*command, *args], env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for args in commands]
    try:
        outs = [proc.communicate(timeout=timeout) for proc in procs]
        return [subprocess.CompletedProcess(proc.args, proc.returncode, *out) for proc, out in zip(procs, outs)]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def run(*args: str, env: dict | None = None, command: list[str] | None = None) -> subprocess.CompletedProcess:
    """Runs `zarrckpt ARGS...` (see `run_together`) and waits for it."""
    return run_together([list(args)], env=env, command=command)[0]


def close() -> None:
    """Ends the zygotes (at the test process's exit)."""
    with _lock:
        while _zygotes:
            _zygotes.popitem()[1].close()


atexit.register(close)
