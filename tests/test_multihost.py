"""Real multi-process JAX: 2 processes x 4 CPU devices on localhost, on a local disk and
on the S3 and GCS servers."""

import multiprocess
import pytest

import zarrckpt
from zarrckpt import _commit

MP_STORES = ["local", "s3", "gcs"]


@pytest.fixture(scope="module", params=MP_STORES)
def saved(request, new_store):
    """A step saved by 2 processes with 4 devices each, on a (2, 4) mesh."""
    store = new_store(request.param)
    results = multiprocess.run("mp_checkpoint", "save", store.url, "10", storage_options=store.options)
    return store, results


def test_two_processes_save_and_commit(saved):
    store, results = saved
    assert zarrckpt.all_steps(store.url, storage_options=store.options) == [10]
    assert [r["latest"] for r in results] == [10, 10]
    # Replicated data is written by both hosts, host (numpy) data by process 0 only.
    assert all(r["writes"]["replicated"] > 0 for r in results)
    assert results[0]["writes"]["host"] > 0 and results[1]["writes"]["host"] == 0


def test_restore_on_two_processes_other_meshes(saved):
    store, _ = saved
    meshes = ["flat8", "4x2"]  # restored one after the other by one job
    results = multiprocess.run("mp_checkpoint", "restore", store.url, *meshes, storage_options=store.options)
    for r in results:
        for mesh, restored in zip(meshes, r["restored"], strict=True):
            assert restored["step"] == 10 and restored["checked"] > 0 and restored["step_value"] == 7, (mesh, restored)


@pytest.mark.parametrize("devices, mesh", [(8, "flat8"), (4, "2x2"), (1, "single")])
def test_restore_on_one_process_other_device_count(saved, devices, mesh):
    store, _ = saved
    (result,) = multiprocess.run("mp_checkpoint", "restore", store.url, mesh, processes=1, devices=devices,
                                 storage_options=store.options)
    assert result["step"] == 10 and result["checked"] > 0


@pytest.mark.parametrize("store", MP_STORES, indirect=True)
def test_failed_write_on_one_process_commits_nothing(store):
    """Process 0 is the one that commits: its own failure must stop the commit as
    surely as another process's (one job fails process 0's writes in one run, then
    process 1's in another). The next save of the step commits, with its values."""
    urls = [f"{store.url}/process-{failing}-fails" for failing in (0, 1)]
    results = multiprocess.run("mp_checkpoint", "fail", urls[0], "0", urls[1], "1", storage_options=store.options)
    for failing, url in enumerate(urls):
        for r in (result["runs"][failing] for result in results):
            assert r["error"] is not None, (failing, results[0]["output"])
            # Every process is told which process failed, on which leaf, and why.
            assert f"process {failing}: " in r["error"] and f"process {1 - failing}: " not in r["error"], r["error"]
            assert "['both']" in r["error"] and "injected write failure" in r["error"], r["error"]
            # Uncommitted; on S3 and GCS absent, as no group metadata is written before the commit.
            left = _commit.State.ABSENT if store.kind in ("s3", "gcs") else _commit.State.UNCOMMITTED
            assert r["latest"] == 1 and r["state"] == left.name, (failing, r)
            assert r["latest_after"] == 2 and r["checked"] > 0, (failing, r)
        assert zarrckpt.all_steps(url, storage_options=store.options) == [1, 2], failing


def test_manager_async_saves_and_restores_on_two_processes(tmp_path):
    results = multiprocess.run("mp_manager", "train", str(tmp_path / "run"))
    for r in results:
        assert r["saved"] == [2, 4, 6] and r["step"] == 6 and r["values"] == [6.0]
    assert zarrckpt.all_steps(str(tmp_path / "run")) == [4, 6]


def test_a_staging_that_fails_on_one_process_fails_the_save_on_both_and_the_next_step_commits_whole(tmp_path):
    """Process 1's copies off the devices fail as its async save starts: its `save`
    raises the runtime's error, process 0's save of the step fails saying nothing was
    committed, and the next save commits every process's chunks (a process whose
    writer never ran fell a save behind the other: its next save was paired with the
    other's failed one, and a step committed with its chunks missing)."""
    run = str(tmp_path / "run")
    first, second = multiprocess.run("mp_manager", "staging_fails", run)
    assert "RESOURCE_EXHAUSTED" in second["said"]["save 1"], second
    assert "nothing was committed" in first["said"]["wait 1"], first
    for r in (first, second):
        assert r["said"]["save 2"] is None and r["said"]["wait 2"] is None, r
        assert r["step"] == 2 and r["values"] == [2.0] and r["steps"] == [2], r
    assert zarrckpt.verify(run + "/0000000002").ok


def test_a_frozen_base_over_two_processes_is_linked_by_each_from_the_second_save(tmp_path):
    """Each process links the chunks it writes: at the second save by their bytes, from
    the third on by the fingerprints of its shards, on its own devices; the last step
    restores alone once the three before it are deleted, one after the other (each
    process deletes together with process 0, never finding a step it already deleted)."""
    results = multiprocess.run("mp_manager", "frozen", str(tmp_path / "run"))
    inodes = {int(step): dict(files) for step, files in results[0]["inodes"].items()}
    assert len(inodes[4]) > 1  # chunks written by both processes
    assert inodes[2] == inodes[1] and inodes[3] == inodes[1] and inodes[4] == inodes[1], inodes
    for r in results:
        assert r["step"] == 4 and r["base"] == 0.5 and r["head"] == 4.0, r
def test_a_chunk_whose_writer_moves_to_another_process_is_written_again_and_no_step_is_listed(tmp_path):
    """Leaves added before the very same arrays move which process writes a replicated
    chunk: that process never made it, so it knows no version of it and writes it
    (where before it listed the step at every commit to learn every process's chunks);
    the sharded leaf's chunks are still linked, and the step commits. No save lists a
    step more than the same save with reuse off."""
    results = multiprocess.run("mp_manager", "grown", str(tmp_path / "run"))
    for r in results:
        assert r["steps"] == [1, 2, 3] and r["exact"], r
        assert r["listings"] == r["without"], r
    inodes = {int(step): leaves for step, leaves in results[0]["inodes"].items()}
    assert inodes[3]["s"] == inodes[2]["s"] and inodes[3]["w"] != inodes[2]["w"], inodes


def test_save_checkpoint_unchanged_since_over_two_processes_links_each_process_s_chunks(tmp_path):
    """Each process links the chunks it writes of the frozen base from the step before;
    the newest step restores exactly once the two before it are deleted."""
    results = multiprocess.run("mp_checkpoint", "unchanged", str(tmp_path / "run"))
    inodes = {int(step): dict(files) for step, files in results[0]["inodes"].items()}
    assert {name.split(".")[1] for name in inodes[3]} == {"0", "1"}, inodes  # rows of both processes
    assert inodes[2] == inodes[1] and inodes[3] == inodes[1], inodes
    for r in results:
        assert r["base_ok"] and r["head_ok"], r


def test_sigterm_to_one_process_of_two_stops_both_loops_at_one_saved_step(tmp_path):
    results = multiprocess.run("mp_manager", "preempted", str(tmp_path / "run"))
    stops = {result["stopped"] for result in results}
    assert len(stops) == 1 and None not in stops, results  # the same step on both, and they stopped
    (stop,) = stops
    assert stop > 15 and results[0]["steps"][-1] == stop, results  # nothing trained after the notice is lost


def test_sigterm_to_one_process_of_two_whose_loop_saves_every_5_steps_stops_both_at_one_saved_step(tmp_path):
    """A loop that calls `save` only when a save is due: JAX agrees on a step that no
    `save` call has, and the notice was lost (no stop, the job killed at the grace
    period). `reached_preemption` asks at every step; the next `save` call saves its
    step, past the policy's interval, and both loops stop there."""
    results = multiprocess.run("mp_manager", "preempted_sometimes", str(tmp_path / "run"))
    stops = {result["stopped"] for result in results}
    assert len(stops) == 1 and None not in stops, results
    (stop,) = stops
    assert stop > 17 and stop % 5 == 0 and results[0]["steps"][-1] == stop, results  # saved where it stopped


def test_manager_background_barrier_times_out_naming_the_missing_process(tmp_path):
    results = multiprocess.run("mp_manager", "timeout", str(tmp_path / "run"))
    error = results[0]["error"]
    assert "manager-save" in error and "processes [1] never arrived" in error, results[0]["output"]
    assert results[0]["waited"] < 8 and results[0]["steps"] == []


def test_an_operations_waits_share_one_timeout(tmp_path):
    """Process 0 keeps process 1 waiting at the save's first agreement, then never
    commits: process 1's wait for the commit is given only what its earlier waits left
    of the save's timeout, so a save cannot take several times its timeout to fail."""
    timeout_s, hold_s = 4.0, 1.0
    results = multiprocess.run("mp_manager", "late", str(tmp_path / "run"), str(timeout_s), str(hold_s))
    late = results[1]
    assert late["error"] == "CoordinationTimeoutError", late["output"]
    *earlier, commit = late["waits"]
    assert commit["key"].endswith("/commit") and commit["timed_out"], late["waits"]
    operation = commit["key"].rsplit("/", 1)[0] + "/"
    earlier = [w for w in earlier if w["key"].startswith(operation)]
    waited = sum(w["waited_s"] for w in earlier)
    assert waited >= hold_s and not any(w["timed_out"] for w in earlier), late["waits"]
    # zarrckpt times each wait around the call timed here: it counts at least as much.
    assert commit["timeout_ms"] <= (timeout_s - waited) * 1000, late["waits"]


def test_a_resume_with_a_target_from_jitted_optax_init_trains_on_two_processes(tmp_path):
    """`jax.jit(tx.init)(params)`, params sharded over both processes' devices, makes mu
    and nu uncommitted: a new job that restores into such a target gets every leaf back
    as committed (or not) and placed as the target's, and its jitted step runs (a leaf
    come back committed to one device raised "Received incompatible devices")."""
    run = str(tmp_path / "run")
    multiprocess.run("mp_manager", "optax_save", run)
    results = multiprocess.run("mp_manager", "optax_resume", run)
    for r in results:
        assert not all(r["target_committed"]), r  # the case at stake: uncommitted leaves in the target
        assert r["step"] == 1 and all(r["same"]) and r["error"] is None, r
        assert r["count"] == 2, r  # the saved step's count, and the resumed step's
