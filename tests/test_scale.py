"""Scale: 4 processes x 2 CPU devices on localhost. What grows with the process count
must not: coordination calls per process, bytes read from the store for replicated
state, objects per small leaf. A process killed mid-save is named by the others."""

import shutil
from collections.abc import Iterable

import multiprocess
import pytest

import zarrckpt
from zarrckpt import _commit, _storage


def then(actions: Iterable[list[str]]) -> list[str]:
    """Several actions of the worker, one after the other in one job (see workers/mp_scale.py)."""
    words: list[str] = []
    for action in actions:
        words += (["+"] if words else []) + action
    return words


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Step 1 saved by 4 processes with 2 devices each."""
    directory = str(tmp_path_factory.mktemp("scale") / "run")
    results = multiprocess.run("mp_scale", "save", directory, "1", processes=4, devices=2)
    return directory, results


LAYOUTS = ("replicated", "mixed", "sharded")


@pytest.mark.parametrize("processes", [4, 2, 1])
def test_four_processes_save_and_restore_on_four_two_and_one(saved, processes):
    directory, _ = saved
    assert zarrckpt.all_steps(directory) == [1]
    # One job restores onto each layout in turn.
    results = multiprocess.run("mp_scale", *then(["restore", directory, layout] for layout in LAYOUTS),
                               processes=processes, devices=2)
    for r in results:  # every addressable shard checked on every process
        for layout, restored in zip(LAYOUTS, r["done"], strict=True):
            assert restored["step"] == 1 and restored["step_value"] == 7 and restored["checked"] > 0, (
                processes, layout, restored)


@pytest.mark.parametrize("layout, inflight", [("replicated", 2**31), ("mixed", 2**31), ("replicated", 4096)])
def test_replicated_state_is_read_from_the_store_once(saved, layout, inflight):
    """Load and broadcast: 4 processes that each need all (or a host's share) of the
    state read it about once in total, and get the right values on every device; with
    a small max_inflight_bytes the leaves are shared a few at a time. A process late
    with its part (on a busy machine, any may be) has it read again by its buddy: those
    bytes are counted apart (`relief_bytes_read`), and only they are read twice."""
    directory, _ = saved
    results = multiprocess.run("mp_scale", *then(["restore", directory, layout, broadcast, str(inflight)]
                                                 for broadcast in ("on", "off")), processes=4, devices=2)
    shared, alone = ([r["done"][i] for r in results] for i in (0, 1))
    checkpoint = shared[0]["checkpoint_bytes"]
    read_shared = sum(r["bytes_read"] - r["relieved"] for r in shared) / checkpoint
    read_alone = sum(r["bytes_read"] for r in alone) / checkpoint
    assert all(r["checked"] > 0 for r in shared + alone)
    # Bytes are counted exactly: 1.006 here, the group metadata each process reads.
    assert read_shared <= 1.01, (read_shared, [r["bytes_read"] for r in shared])
    if layout == "replicated":
        assert read_alone > 3.5  # without it, every host reads everything it needs itself


def test_coordination_calls_per_process_do_not_grow_with_the_process_count(saved, tmp_path):
    counts = {}
    for processes in (2, 4):
        directory = str(tmp_path / f"p{processes}")
        results = multiprocess.run("mp_scale", *then([["save", directory, "1"],
                                                      ["restore", directory, "sharded", "off"]]),
                                   processes=processes, devices=2)
        counts[processes] = ([r["done"][0]["calls"] for r in results], [r["done"][1]["calls"] for r in results])
    (save2, restore2), (save4, restore4) = counts[2], counts[4]
    assert max(save4) <= max(save2) and max(restore4) <= max(restore2), counts
    assert max(save4) <= 8 and max(restore4) <= 3, counts  # a handful, whatever the process count


def test_a_small_leaf_is_one_object_per_writing_process(saved):
    directory, _ = saved
    loc = _storage.resolve(directory).step(1)
    small = [k for k in (e.name for e in loc.walk()) if k.startswith("small/c.")]
    assert len(small) == 4  # 4 KiB over 8 devices of 4 hosts: each host merges its two shards
    assert zarrckpt.verify(loc.url).ok


def test_a_process_killed_mid_save_is_named_and_the_restart_resumes(saved, tmp_path):
    directory = str(tmp_path / "run")
    shutil.copytree(saved[0], directory)  # step 1, as 4 processes saved it
    results = multiprocess.run("mp_scale", "kill", directory, "2", "2", processes=4, devices=2, expect_ok=False,
                               timeout=120)
    # The victim SIGKILLed; the others leave cleanly, process 0 (the coordination service) last.
    assert [r["returncode"] for r in results] == [0, 0, -9, 0], [r["output"][-2000:] for r in results]
    for pid in (0, 1, 3):
        r = results[pid]
        assert "error" in r, r["output"][-3000:]
        assert "processes [2] never arrived" in r["error"], r["error"]
        assert r["latest"] == 1
    assert _commit.head(_storage.resolve(directory).step(2)).state is not _commit.State.COMMITTED
    restarted = multiprocess.run("mp_scale", "restore", directory, "sharded", processes=4, devices=2)
    assert [r["step"] for r in restarted] == [1, 1, 1, 1]


def test_a_listing_of_many_directories_keeps_one_descriptor_open_per_level(tmp_path):
    """A step of 600 arrays listed under a limit of 128 open files (a shell's default is
    1,024; an import of a large model has thousands of arrays): the listing, which
    copies, overwrites, retention and the check of unchanged chunks make, opens a
    directory only as it visits it, never all of one level at once."""
    import subprocess
    import sys

    for i in range(600):
        (tmp_path / f"leaf{i}").mkdir()
        (tmp_path / f"leaf{i}" / "c.0").write_bytes(b"x")
    code = ("import resource, sys; from zarrckpt import _storage\n"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (128, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))\n"
            "print(len(_storage.resolve(sys.argv[1]).walk()))")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["600"], done.stderr[-2000:]
