"""A store that speaks S3's or GCS's API but ignores their conditions (S3 itself before
2024, and S3-compatible servers since): S3 (moto) and GCS (the emulator) behind a proxy
(tests/fault_proxy.py) that forwards every request without If-None-Match, the copy's
source condition (x-amz-copy-source-if-match) and GCS's generation conditions, and
answers a copy with the source's old ETag.

zarrckpt asks the store at the first lease claimed on it whether it honours them, and,
where it does not, says so, takes the lease without relying on them, and makes
unchanged chunks through the process instead of copying them inside the store."""

import logging
import threading

import fsspec
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fault_proxy import FaultProxy

import zarrckpt
from zarrckpt._run import lease as _lease

BEAT = 0.2


@pytest.fixture(params=["s3", "gcs"])
def unconditional(request):
    """A run in a new bucket, storage options through a proxy that drops every
    condition, the server, and options straight to it."""
    server = request.getfixturevalue(f"{request.param}_server")
    proxy = FaultProxy(server.endpoint, "s3" if request.param == "s3" else "gs")
    proxy.ignores_conditions = True
    url = f"{server.protocol}://{server.new_bucket()}/run"
    yield url, {**server.options(), "endpoint_url": proxy.endpoint}, proxy, server
    proxy.stop()


def lease_area(url, options):
    fs = fsspec.filesystem(url.split("://")[0], **options)
    fs.invalidate_cache()
    return sorted(path.rpartition("/")[2] for path in fs.ls(f"{url}/{_lease.LEASES}", detail=False))


def test_a_store_that_ignores_if_none_match_is_warned_about_when_the_lease_is_taken(unconditional, caplog):
    """The same bucket straight on the server (which honours the conditions: no warning)
    and through the proxy (the warning, naming the run). Before: nothing asked whether
    the store honours If-None-Match, so no warning either way, and the lease was taken by
    a create the store did not make exclusive. The probe's objects are gone after both."""
    url, options, _, server = unconditional
    with caplog.at_level(logging.WARNING, logger="zarrckpt"):
        with zarrckpt.CheckpointManager(url, storage_options=server.options(), heartbeat_s=BEAT):
            pass
        assert not any("only if it is absent" in r.getMessage() for r in caplog.records)
        with zarrckpt.CheckpointManager(url, storage_options=options, heartbeat_s=BEAT):
            pass
    assert any("cannot create an object only if it is absent" in r.getMessage() and url in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert lease_area(url, server.options()) == [_lease.lease_key(2).rpartition("/")[2]]


def test_two_managers_racing_on_a_store_that_ignores_if_none_match_never_both_hold(unconditional):
    """Two managers claim one run at the same moment: the proxy holds the first write of
    each into the lease area of number 1 until both are in, then forwards both. Before:
    both writes went through (the store ignored If-None-Match) and both held the run."""
    url, options, proxy, server = unconditional
    together = threading.Barrier(2)
    first_two = [2]
    lock = threading.Lock()

    def hold_the_first_two(kind, method, target, body):
        key = f"{_lease.LEASES}/{1:010d}"
        if kind == "write" and (key in target or key.encode() in body):
            with lock:
                mine, first_two[0] = first_two[0] > 0, first_two[0] - 1
            if mine:
                try:
                    together.wait(60)
                except threading.BrokenBarrierError:  # the other never wrote there: let it go
                    pass
        return None

    proxy.fault = hold_the_first_two
    outcomes, managers = {}, {}

    def claim(name):
        try:
            managers[name] = zarrckpt.CheckpointManager(url, storage_options=options, heartbeat_s=BEAT)
            outcomes[name] = "held"
        except zarrckpt.DirectoryInUseError as e:
            outcomes[name] = f"refused: {e}"

    threads = [threading.Thread(target=claim, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    for manager in managers.values():
        manager.close()
    assert sorted(outcomes) == ["a", "b"], outcomes
    assert list(outcomes.values()).count("held") <= 1, outcomes
    proxy.fault = None
    with zarrckpt.CheckpointManager(url, storage_options=options, heartbeat_s=BEAT) as mgr:  # nothing left in the way
        mgr.save(1, {"w": np.arange(4.0)})
    assert not [name for name in lease_area(url, server.options()) if not name.isdigit()]  # no claim, no probe


def test_reuse_on_a_store_that_ignores_the_copy_condition_never_commits_a_rewritten_chunk(unconditional):
    """A leaf unchanged since step 1 whose chunk in step 1 another program rewrote (with
    another valid chunk of it) after step 1 was committed. Before: its chunk of step 2
    was copied inside the store without the source's condition, the store's answer
    named the old ETag, and step 2 committed holding the rewritten chunk."""
    url, options, _, server = unconditional
    frozen = jnp.arange(2 * 2**18, dtype=jnp.float32).reshape(2, 2**18)
    with zarrckpt.CheckpointManager(url, storage_options=options, heartbeat_s=BEAT, async_save=False,
                                    max_chunk_bytes=2**20, min_chunk_bytes=2**10) as mgr:
        mgr.save(1, {"frozen": frozen, "step": jnp.int32(1)})
        fs = fsspec.filesystem(url.split("://")[0], **server.options())
        chunks = sorted(p for p in fs.find(f"{url}/0000000001/frozen") if not p.endswith("zarr.json"))
        assert len(chunks) == 2, chunks
        fs.pipe_file(chunks[0], fs.cat_file(chunks[1]))  # a valid chunk of the leaf, in the wrong place
        server.recorder.reset()
        try:
            mgr.save(2, {"frozen": frozen, "step": jnp.int32(2)})
        except zarrckpt.CheckpointWriteError as e:
            assert "0000000001/frozen" in str(e), e  # the rewritten chunk named, as where the store checks it
        copies = [target for _, target in server.recorder.copies]
        rewrites = [target for method, target in server.recorder.requests if "/rewriteTo/" in target]
        steps = mgr.all_steps()
    if 2 in steps:
        restored = zarrckpt.load_checkpoint(url, 2, storage_options=server.options())
        np.testing.assert_array_equal(np.asarray(restored["frozen"]), np.asarray(jax.device_get(frozen)))
    assert copies == [] and rewrites == [], (copies, rewrites)  # made through this process


def test_a_failed_commit_that_may_land_late_leaves_the_step_whole(unconditional, monkeypatch):
    """On a store that ignores If-None-Match a commit is a plain write, which a request
    abandoned at its deadline may still apply later. A manager's save whose every commit
    request is held fails; the step's chunks stay (the failed save's clean-up stands
    back once the commit was asked for), so the commit that lands late makes a whole
    step, never a committed step without its chunks (before: the chunks were deleted,
    and the late commit made step 2 the newest, unreadable)."""
    from fault_proxy import Late

    from zarrckpt import _storage

    monkeypatch.setattr(_storage.guard, "_FIRST_BACKOFF_S", 0.001)
    url, options, proxy, server = unconditional
    options = {**options, "request_timeout_s": 1.0}
    state = {"w": np.arange(1024, dtype=np.float32), "b": np.ones(5)}

    def commits(kind, target, body):
        return kind == "write" and "0000000002/zarr.json" in target + body.decode("latin-1") and \
            b'"write_completed":true' in body

    with zarrckpt.CheckpointManager(url, storage_options=options, async_save=False) as mgr:
        mgr.save(1, state)
        proxy.once(Late(600), commits, times=10)
        with pytest.raises(zarrckpt.CheckpointWriteError):
            mgr.save(2, {**state, "w": state["w"] + 1})
    proxy.settle()  # the held commits land now
    direct = server.options()
    for step in zarrckpt.all_steps(url, storage_options=direct):
        restored = zarrckpt.load_checkpoint(url, step, storage_options=direct)
        np.testing.assert_array_equal(restored["w"], state["w"] + step - 1)
