"""Per-process leaves saved by several processes, restored without a target."""

from __future__ import annotations

import pytest
from multiprocess import run

import zarrckpt


@pytest.fixture(scope="module")
def four_processes_saved(tmp_path_factory):
    """A checkpoint saved by a 4-process job, each process with a value of its own, and
    what each process got back restoring it without a target."""
    url = str(tmp_path_factory.mktemp("four") / "c")
    return url, run("mp_per_process", "save", url, processes=4, devices=1)


def test_each_of_the_saving_processes_gets_its_own_value_back_without_a_target(four_processes_saved):
    _, results = four_processes_saved
    for pid, result in enumerate(results):
        assert result["restored_type"] == "PerProcess"
        assert result["restored"] == {"process": pid, "position": 10 * pid}


def test_another_process_count_gets_every_value_by_process_index_without_a_target(four_processes_saved):
    url, _ = four_processes_saved
    restored = zarrckpt.load_pytree(url)
    assert restored["data"] == {p: {"process": p, "position": 10 * p} for p in range(4)}
    assert restored["w"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    # With a target, the process count must match unless the target says otherwise.
    with pytest.raises(zarrckpt.CheckpointMismatchError, match=r"saved by 4 process\(es\), restored by 1"):
        zarrckpt.load_pytree(url, {"data": zarrckpt.PerProcess(None), "w": restored["w"]})
