"""Python processes for the tests, forked from one that has imported zarrckpt already.

Starting Python and importing JAX, zarr and zarrckpt takes 1.5 s of CPU; the work of
most of the processes the suite starts (a `zarrckpt` command, a worker of a
multi-process job) takes less. Here a process that has imported them once (a zygote)
forks each one instead: `spawn` runs `python ARGV...` as Python would (`runpy`,
`sys.argv`, `sys.path[0]`, stdin at /dev/null, the normal interpreter exit with its
atexit handlers), and returns a `subprocess.Popen` of it, to wait for, poll, signal and
kill as any other.

The test process waits for the processes itself: the zygote forks a middle process
that forks the one asked for and exits, and the test process, a child subreaper
(prctl), is where the kernel hands the orphan. The middle has exited before the pid is
sent, so the process is the test's by the time it has its pid.

A forked process has the environment its zygote imported zarrckpt in, except for the
variables in `READ_LATE`, which nothing reads before a process's own code runs: a
spawn with other environment variables gets zygotes of their own. Each environment
has two, taking turns, so that processes started one after the other (a job's process 0
and 1) do not share a hash seed (the order of a set of strings), as processes on
different hosts do not.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

# Read by XLA when the backend starts, by the tests' workers when they start, by
# nothing (a pytest variable that differs from test to test).
READ_LATE = frozenset({"XLA_FLAGS", "ZARRCKPT_TEST_CHANNEL", "ZARRCKPT_TEST_STORAGE_OPTIONS", "PYTEST_CURRENT_TEST"})
# Every zygote's: one BLAS thread, so that it has no thread to lose in a fork.
_ZYGOTE_ENV = {"OPENBLAS_NUM_THREADS": "1"}

# Runs in the zygote: a request a line of JSON on stdin, the reply (the new process's
# pid) a line on stdout.
_ZYGOTE = r"""
import json, os, sys, tempfile

# What the import prints (a warning, say) is every process's output, as it would be.
replies_fd, errors_fd = os.dup(1), os.dup(2)
printed = [tempfile.TemporaryFile(), tempfile.TemporaryFile()]
os.dup2(printed[0].fileno(), 1)
os.dup2(printed[1].fileno(), 2)


def restore():
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(replies_fd, 1)
    os.dup2(errors_fd, 2)

try:
    import zarrckpt._cli.commands  # noqa: F401  (JAX, numpy, zarr, fsspec and zarrckpt, once)
except BaseException:  # says why on the zygote's own stderr
    restore()
    for f in printed:
        f.seek(0)
        os.write(2, f.read())
    raise
restore()
for fd in (replies_fd, errors_fd):
    os.close(fd)
for i, f in enumerate(printed):
    printed[i] = (f.seek(0), f.read())[1]
    f.close()

tasks = os.listdir("/proc/self/task")
if len(tasks) != 1:  # a fork copies one thread only: another's locks would stay held in the child
    sys.exit(f"the zygote runs {len(tasks)} threads")
requests, replies = sys.stdin.buffer, sys.stdout
while line := requests.readline():
    request = json.loads(line)
    pid_r, pid_w = os.pipe()
    middle = os.fork()
    if middle == 0:
        os.close(pid_r)
        # Its output files there before its pid is: a test may read them at once.
        out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        err = out if request["stderr"] is None else os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                                                             0o600)
        pid = os.fork()
        if pid:
            os.write(pid_w, b"%d" % pid)
            os._exit(0)
        # The process asked for: falls out of this loop into Python's own exit, never on
        # into it (it must not fork processes of its own).
        os.close(pid_w)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(err, 2)  # the same open file as stdout where asked: as Popen's stderr=STDOUT
        for fd in {null, out, err}:
            os.close(fd)
        os.write(1, printed[0])
        os.write(2, printed[1])
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = request["argv"]
        import runpy
        if sys.argv[0] == "-m":
            sys.argv = sys.argv[1:]
            sys.path[0] = request["cwd"]
            runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
            runpy.run_path(sys.argv[0], run_name="__main__")
        sys.exit(0)
    os.close(pid_w)
    with os.fdopen(pid_r, "rb") as f:
        pid = f.read()
    os.waitpid(middle, 0)
    replies.write(pid.decode() + "\n")
    replies.flush()
"""


class _Zygote:
    def __init__(self, env: dict[str, str]) -> None:
        _become_subreaper()
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _ZYGOTE], env={**env, **_ZYGOTE_ENV},
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def fork(self, request: dict) -> int:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        try:
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
            reply = self._proc.stdout.readline()
        except BaseException:  # its reply unread: it must answer no later request
            self._proc.kill()
            raise
        if not reply:
            raise RuntimeError(f"the tests' zygote exited {self._proc.wait()}")
        return int(reply)

    def alive(self) -> bool:
        return self._proc.poll() is None

    def close(self) -> None:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.close()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._proc.stdout.close()


class _Forked(subprocess.Popen):
    """A Popen of a process a zygote forked: Popen's own wait, poll and signals, on a
    child it did not start (`_execute_child` is where Popen starts one)."""

    def __init__(self, zygote: _Zygote, request: dict) -> None:
        self._zygote, self._request = zygote, request
        super().__init__([sys.executable, *request["argv"]])

    def _execute_child(self, *args, **kwargs) -> None:  # type: ignore[override]
        self.pid = self._zygote.fork(self._request)
        self._child_created = True


def _become_subreaper() -> None:
    PR_SET_CHILD_SUBREAPER = 36
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


# Two by environment (see the module's docstring), the next to fork first; those of the
# last two environments used are kept.
_zygotes: dict[str, list[_Zygote]] = {}
_lock = threading.Lock()


def spawn(argv: list[str], *, env: dict[str, str], stdout: Path, stderr: Path | None = None) -> subprocess.Popen:
    """Starts `python ARGV...` (`-m MODULE ...` or `SCRIPT ...`) in environment `env`,
    its output to the file `stdout` and its errors to `stderr` (None: the same file)."""
    if env.get("OPENBLAS_NUM_THREADS", "1") != "1":
        raise ValueError("a forked process has the zygote's one BLAS thread: start it with subprocess instead")
    key = json.dumps({k: v for k, v in sorted(env.items()) if k not in READ_LATE and k not in _ZYGOTE_ENV})
    request = {"argv": argv, "env": env, "cwd": os.getcwd(), "stdout": str(stdout),
               "stderr": None if stderr is None else str(stderr)}
    with _lock:
        pair = []
        for zygote in _zygotes.pop(key, []):
            if zygote.alive():
                pair.append(zygote)
            else:
                zygote.close()
        pair += [_Zygote(env) for _ in range(2 - len(pair))]
        while len(_zygotes) >= 2:  # the oldest first
            for zygote in _zygotes.pop(next(iter(_zygotes))):
                zygote.close()
        _zygotes[key] = [pair[1], pair[0]]
        return _Forked(pair[0], request)


def close() -> None:
    """Ends the zygotes (at the test process's exit)."""
    with _lock:
        while _zygotes:
            for zygote in _zygotes.popitem()[1]:
                zygote.close()


atexit.register(close)
