"""A lease holder stopped (SIGSTOP: a paused or live-migrated VM, a swapping host)
longer than its lease, while another job takes the run over, then resumed: the stale
holder's save fails and says so, it deletes nothing of the other job's, and no
committed step holds chunks of two saves. S3 (moto) and GCS (the emulator); the stale
holder runs in a PID namespace of its own (another container, as far as the lease can
tell) and talks to the store through a proxy (tests/fault_proxy.py) that stops it at a
chosen request."""

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from fault_proxy import RESET, FaultProxy

import zarrckpt
from zarrckpt import _storage

WORKER = Path(__file__).parent.parent / "workers" / "paused_holder.py"


@pytest.fixture(scope="module", autouse=True)
def pid_namespaces():
    if subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True).returncode != 0:
        pytest.skip("cannot make a PID namespace here (unshare --pid needs root)")


@pytest.fixture(params=["s3", "gcs"])
def server(request):
    return request.getfixturevalue(f"{request.param}_server")


def tree(value):
    return {"w": np.full((64, 64), value, np.float32), "b": np.full(5, value)}


def objects(url, options):
    """Every object below `url`, by key, with its version (S3's ETag, GCS's generation)."""
    return {entry.name: entry.version for entry in _storage.resolve(url, options).walk()}


class StaleHolder:
    """The paused_holder worker, saving `step` through a proxy that stops it (its whole
    process group) at the first request `stop_at(target, body)` picks, once: that request
    lands, its answer waits for the worker to resume. While it is stopped, renewals of
    its lease already on their way are lost."""

    def __init__(self, server, tmp_path, url, step, keep_last, stop_at):
        self.proxy = FaultProxy(server.endpoint, "s3" if server.protocol == "s3" else "gs")
        self.stopped = threading.Event()
        self.out = tmp_path / "outcome.json"
        lock = threading.Lock()
        fired = []

        def fault(kind, method, target, body):
            with lock:
                if self.stopped.is_set():
                    return RESET if "zarrckpt.leases" in target or b"zarrckpt.leases" in body else None
                # Once: a write after the resume (the lease's renewal, the stopped request
                # tried again past its deadline) must not stop it again, for good.
                if kind == "write" and not fired and stop_at(target, body):
                    fired.append(target)
                    os.killpg(self.job.pid, signal.SIGSTOP)
                    self.stopped.set()
            return None

        self.proxy.fault = fault
        options = {**server.options(), "endpoint_url": self.proxy.endpoint}
        env = dict(os.environ, JAX_PLATFORMS="cpu", ZARRCKPT_TEST_STORAGE_OPTIONS=json.dumps(options))
        self.job = subprocess.Popen(["unshare", "--pid", "--fork", sys.executable, str(WORKER), url, str(self.out),
                                     str(step), str(keep_last)], env=env, start_new_session=True)

    def wait_stopped(self):
        assert self.stopped.wait(120), f"the stale holder exited {self.job.poll()} before it was stopped"

    def resume(self):
        with self.proxy._lock:
            self.stopped.clear()
        os.killpg(self.job.pid, signal.SIGCONT)
        assert self.job.wait(timeout=300) == 0
        return json.loads(self.out.read_text())

    def stop(self):
        if self.job.poll() is None:
            os.killpg(self.job.pid, signal.SIGKILL)
            self.job.wait()
        self.proxy.stop()


def taking_over(url, options, **kwargs):
    """A manager of the run, taken over from the stopped holder. Looked for twice: a
    renewal of the holder's already past the proxy when the stop came may land just
    after the first look began, and reads as a live holder; a second look sees none."""
    try:
        return zarrckpt.CheckpointManager(url, storage_options=options, heartbeat_s=0.5, async_save=False,
                                          max_chunk_bytes=1024, **kwargs)
    except zarrckpt.DirectoryInUseError:
        return zarrckpt.CheckpointManager(url, storage_options=options, heartbeat_s=0.5, async_save=False,
                                          max_chunk_bytes=1024, **kwargs)


def in_body_or_target(key, *, committing=None):
    def which(target, body):
        if key not in target and key.encode() not in body:
            return False
        return committing is None or (b'"write_completed":true' in body) == committing
    return which


def test_a_holder_paused_mid_save_past_its_lease_fails_its_save_and_leaves_the_new_holder_s_step_whole(
        server, tmp_path):
    """The stale holder is stopped at the 5th of step 2's 16 chunks of `w`; the new holder
    restores step 1 and saves step 2 of its own; the stale holder resumes. Before: both
    were told step 2 committed, the stale one having replaced the new one's commit and
    most of its chunks ("late requests of another save", deleted)."""
    url = f"{server.protocol}://{server.new_bucket()}/run"
    direct = server.options()
    seen = []

    def fifth_chunk(target, body):
        if not in_body_or_target("run/0000000002/w/c.")(target, body):
            return False
        seen.append(target)
        return len(seen) == 5

    stale = StaleHolder(server, tmp_path, url, 2, 5, fifth_chunk)
    try:
        stale.wait_stopped()
        with taking_over(url, direct) as mgr:
            state, restored = mgr.restore(tree(0.0))
            assert restored == 1 and np.all(np.asarray(state["w"]) == 101.0)
            mgr.save(2, tree(202.0))
        made = objects(f"{url}/0000000002", direct)
        said = stale.resume()
    finally:
        stale.stop()
    assert said["outcome"] == "failed" and said["error"] == "DirectoryInUseError", said
    assert f"{url} was taken over by another CheckpointManager" in said["message"], said
    assert {k: v for k, v in objects(f"{url}/0000000002", direct).items() if k in made} == made  # none deleted
    assert zarrckpt.all_steps(url, storage_options=direct) == [1, 2]
    assert zarrckpt.verify(f"{url}/0000000002", storage_options=direct).ok
    step2 = zarrckpt.load_checkpoint(url, 2, tree(0.0), storage_options=direct)
    assert np.all(np.asarray(step2["w"]) == 202.0) and np.all(np.asarray(step2["b"]) == 202.0)


def test_a_holder_paused_at_its_commit_past_its_lease_deletes_no_step_in_its_retention(server, tmp_path):
    """The stale holder (keep_last=1) is stopped as its commit of step 2 goes out, before
    its retention; the new holder saves step 3 keeping all three; the stale holder
    resumes. Before: its retention deleted steps 1 and 2, which the new holder keeps."""
    url = f"{server.protocol}://{server.new_bucket()}/run"
    direct = server.options()
    stale = StaleHolder(server, tmp_path, url, 2, 1, in_body_or_target("run/0000000002/zarr.json", committing=True))
    try:
        stale.wait_stopped()
        with taking_over(url, direct, keep_last=3) as mgr:
            assert mgr.restore(tree(0.0))[1] == 2
            mgr.save(3, tree(303.0))
        made = objects(url, direct)
        said = stale.resume()
    finally:
        stale.stop()
    assert said["outcome"] == "failed" and "taken over" in said["message"], said
    assert zarrckpt.all_steps(url, storage_options=direct) == [1, 2, 3]
    assert {k: v for k, v in objects(url, direct).items() if k in made and "zarrckpt.leases" not in k} == \
        {k: v for k, v in made.items() if "zarrckpt.leases" not in k}


def test_a_holder_paused_before_its_commit_past_its_lease_commits_nothing_into_the_run_taken_over(
        server, tmp_path):
    """The stale holder is stopped at its last chunk of `w` in step 2; the new holder
    restores step 1 and saves step 3, leaving step 2 alone; the stale holder resumes,
    writes the rest, and comes to its commit. Before: it committed step 2 into the run
    the other job holds."""
    url = f"{server.protocol}://{server.new_bucket()}/run"
    direct = server.options()
    stale = StaleHolder(server, tmp_path, url, 2, 5, in_body_or_target("run/0000000002/w/c.15.0"))
    try:
        stale.wait_stopped()
        with taking_over(url, direct) as mgr:
            assert mgr.restore(tree(0.0))[1] == 1
            mgr.save(3, tree(303.0))
        said = stale.resume()
    finally:
        stale.stop()
    assert said["outcome"] == "failed" and said["error"] == "DirectoryInUseError", said
    assert f"{url} was taken over by another CheckpointManager" in said["message"], said
    assert "step 2 not committed" in said["message"], said
    assert zarrckpt.all_steps(url, storage_options=direct) == [1, 3]
