"""A slow process does not hold a restore with load and broadcast: its buddy reads its
part and sends it over the device network (`_restore.relief`). Two real JAX processes
(gloo), process 1's chunk reads held in the ways the worker lists."""

import multiprocess
import pytest


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("relief") / "run")
    multiprocess.run("mp_relief", "save", directory)
    return directory


def test_a_process_whose_reads_never_finish_is_relieved_and_both_restore_exactly(saved):
    fast, slow = multiprocess.run("mp_relief", "restore", saved, "stuck")
    assert fast["checked"] == slow["checked"] == 6 * 4, (fast, slow)
    assert fast["relieved"] > 0 and fast["given_up"] == 0, fast
    # Its held reads were given up, and their failure once let go was dropped.
    assert slow["relieved"] == 0 and slow["given_up"] > 0, slow


def test_a_relieved_process_whose_stuck_reads_hold_its_byte_budget_moves_on(saved):
    """With a budget of 4 KiB, each group of leaves is about one leaf, and process 1's
    stuck reads of the first hold all of it: the reads of the groups after, relieved in
    turn, are given up without taking bytes, so the restore ends (without that, not
    before the stuck reads were let go, after it)."""
    fast, slow = multiprocess.run("mp_relief", "restore", saved, "stuck", "4096", timeout=90)
    assert fast["checked"] == slow["checked"] == 6 * 4, (fast, slow)
    assert fast["relieved"] > 0 and slow["given_up"] > 0, (fast, slow)


def test_a_leaf_no_process_can_read_for_another_is_shared_as_always_beside_relieved_ones(saved):
    """A complex leaf (two floats, no integers of its width to OR) in the same group as
    relieved leaves: its reads on the slow process are waited for (and, first in the
    tree's order, outlast the others'), the others' are read by the fast process too,
    and every leaf is exact on both processes."""
    fast, slow = multiprocess.run("mp_relief", "restore", saved, "slow", timeout=120)
    assert fast["checked"] == slow["checked"] == 7 * 4, (fast, slow)
    assert fast["relieved"] > 0, fast


def test_a_failed_spare_read_leaves_the_slow_process_to_read_its_own_part(saved):
    fast, slow = multiprocess.run("mp_relief", "restore", saved, "spare-fails")
    assert fast["checked"] == slow["checked"] == 6 * 4, (fast, slow)
    assert fast["relieved"] == 0 and slow["given_up"] == 0, (fast, slow)


def test_with_both_processes_fast_the_restore_is_exact(saved):
    results = multiprocess.run("mp_relief", "restore", saved, "none")
    assert all(r["checked"] == 6 * 4 for r in results), results


def test_a_process_whose_reads_fail_makes_the_other_raise_not_wait(saved):
    fast, slow = multiprocess.run("mp_relief", "restore", saved, "denied", timeout=120)
    assert "error" in slow and "checked" not in slow, slow
    # Process 0 learns it at the group's barrier, named by process, instead of waiting
    # in the device collective for a process that will never come.
    assert fast["error_type"] == "CheckpointError" and "process 1" in fast["error"], fast
    assert "denied on purpose" in fast["error"], fast
