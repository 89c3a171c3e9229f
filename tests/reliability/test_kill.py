"""SIGKILL at random moments while saving and while deleting: whatever is committed
restores bit-exactly, nothing that was committed is lost, and saving goes on.

Each launch of the worker is an attempt with values of its own (see
workers/kill_target.py): the step a kill cut short is saved again with other values,
so a committed step must hold exactly those of the attempt that committed it."""

import random
import shutil
import time

import multiprocess
import numpy as np
from workers.common import distinct_values

import zarrckpt
from zarrckpt import _commit, _storage
from zarrckpt._format import naming as _naming

# Recorded in docs/reliability.md; keep them in step with the figures there.
SINGLE_PROCESS_KILLS = 8
TWO_PROCESS_KILLS = 3
RETENTION_KILLS = 5


class Watched:
    """A launched worker, and what it says (through its own file, see multiprocess.said)."""

    def __init__(self, proc):
        self.proc = proc

    @property
    def lines(self) -> list[str]:
        return multiprocess.said(self.proc)

    def wait_ready(self, timeout: float) -> bool:
        return self.wait_for("ready", timeout)

    def wait_for(self, line: str, timeout: float) -> bool:
        """Whether the worker says `line` within `timeout` (False once it has exited)."""
        deadline = time.monotonic() + timeout
        while line not in self.lines:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                return False
            time.sleep(0.05)
        return True

    def committed(self) -> list[int]:
        return [int(line.split()[1]) for line in self.lines if line.startswith("committed ")]


def run_and_kill(mode, directory, *args, attempt, committed_by, processes=1, delay, victim=0):
    """Launches attempt number `attempt` and kills it after `delay`; records in
    `committed_by` (step -> attempt) the steps it committed: those committed now that
    were not before (once committed, a step is never saved again). Returns the steps
    the workers said they committed."""
    before = set(zarrckpt.all_steps(directory))
    workers = [Watched(p) for p in multiprocess.launch("kill_target", mode, directory, *args, str(attempt),
                                                       processes=processes, devices=4)]
    try:
        for w in workers:
            assert w.wait_ready(120), "\n".join(w.lines)
        time.sleep(delay)
        workers[victim].proc.kill()  # SIGKILL: no cleanup of any kind
        time.sleep(0.2)
    finally:
        for w in workers:
            w.proc.kill()
            w.proc.wait()
    committed = sorted({s for w in workers for s in w.committed()})
    shutil.rmtree(workers[0].proc.said.parent, ignore_errors=True)
    for step in set(zarrckpt.all_steps(directory)) - before:
        committed_by[step] = attempt
    return committed


def assert_committed_steps_are_whole(directory, must_have, committed_by):
    """Every committed step restores exactly the values its attempt saved."""
    committed = zarrckpt.all_steps(directory)
    assert set(must_have) <= set(committed), (must_have, committed)
    for step in committed:
        tree = zarrckpt.load_pytree(_storage.resolve(directory).step(step).url)
        assert sorted(tree) == [f"leaf{i}" for i in range(6)], (step, sorted(tree))
        for i in range(6):
            leaf = tree[f"leaf{i}"]
            assert np.array_equal(leaf, distinct_values(i, step, committed_by[step], leaf.shape)), \
                (step, committed_by[step], i)
    return committed


def test_sigkill_while_saving_one_process(tmp_path):
    rng = random.Random(1)
    directory = str(tmp_path / "run")
    reported: list[int] = []
    committed_by: dict[int, int] = {}
    for attempt in range(SINGLE_PROCESS_KILLS):
        start = (zarrckpt.latest_step(directory) or 0) + 1  # the step that was cut short, saved again
        reported += run_and_kill("saves", directory, str(start), attempt=attempt, committed_by=committed_by,
                                 delay=rng.uniform(0.0, 0.8))
        assert_committed_steps_are_whole(directory, reported, committed_by)
    assert reported, "no save ever committed: the kill points are too early to test anything"
    after = (zarrckpt.latest_step(directory) or 0) + 1
    zarrckpt.save_checkpoint(directory, after, {"leaf0": np.full(3, after, np.float32)})
    assert zarrckpt.latest_step(directory) == after


def test_sigkill_one_of_two_processes(tmp_path):
    rng = random.Random(2)
    directory = str(tmp_path / "run")
    reported: list[int] = []
    committed_by: dict[int, int] = {}
    for attempt in range(TWO_PROCESS_KILLS):
        start = (zarrckpt.latest_step(directory) or 0) + 1
        reported += run_and_kill("saves", directory, str(start), attempt=attempt, committed_by=committed_by,
                                 processes=2, delay=rng.uniform(0.3, 1.5), victim=attempt % 2)
        assert_committed_steps_are_whole(directory, reported, committed_by)
    assert reported


def test_sigkill_during_retention(tmp_path):
    rng = random.Random(3)
    directory = str(tmp_path / "run")
    newest_reported = 0
    committed_by: dict[int, int] = {}
    for attempt in range(RETENTION_KILLS):
        reported = run_and_kill("manager", directory, attempt=attempt, committed_by=committed_by,
                                delay=rng.uniform(0.2, 1.0))
        newest_reported = max([newest_reported, *reported])
        committed = assert_committed_steps_are_whole(directory, [], committed_by)
        # keep_last=1: the reported step may already be gone if a newer one committed
        # (and its retention ran) before the kill cut the "committed" line short.
        assert max(committed, default=0) >= newest_reported, (newest_reported, committed)
        # Anything left that is not committed must not look committed to a reader.
        for entry in _storage.resolve(directory).list_dir():
            step = _naming.parse_step_dir_name(entry.name)
            if step is not None and step not in committed:
                assert _commit.head(_storage.resolve(directory).step(step)).state is not _commit.State.COMMITTED
    assert newest_reported
