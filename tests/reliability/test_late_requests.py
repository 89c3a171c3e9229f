"""Requests a store applies after zarrckpt gave up on them: S3 (moto) and GCS (the
emulator) behind a proxy (tests/fault_proxy.py) that holds a request past zarrckpt's
deadline, answers nothing, and forwards it to the store seconds later.

Whatever lands late: no save reported committed ever reads as uncommitted, none
reported failed ever reads as committed, and no read returns values of two saves."""

import numpy as np
import pytest
from fault_proxy import FaultProxy, Late

import zarrckpt
from zarrckpt import _storage

DEADLINE_S = 1.0
LATE = Late(4 * DEADLINE_S)  # lands well after zarrckpt abandoned it (and tried again), and after what follows


@pytest.fixture(autouse=True)
def fast_backoff(monkeypatch):
    monkeypatch.setattr(_storage.guard, "_FIRST_BACKOFF_S", 0.001)


@pytest.fixture(params=["s3", "gcs"])
def proxied(request):
    """A run in a new bucket, the storage options through the proxy (a request deadline
    of DEADLINE_S), the proxy, and options straight to the server."""
    server = request.getfixturevalue(f"{request.param}_server")
    proxy = FaultProxy(server.endpoint, "s3" if request.param == "s3" else "gs")
    url = f"{server.protocol}://{server.new_bucket()}/run"
    yield url, {**server.options(), "endpoint_url": proxy.endpoint, "request_timeout_s": DEADLINE_S}, proxy, \
        server.options()
    proxy.stop()


def writes(key: str, *, committing: bool | None = None):
    """Picks the writes of the object `key` (below the bucket), S3's PUTs (the key in
    the path) and GCS's uploads (the key in the body); with `committing`, only those
    whose body does (or does not) carry the commit marker."""
    def which(kind, target, body):
        if kind != "write" or (key not in target and key.encode() not in body):
            return False
        return committing is None or (b'"write_completed":true' in body) == committing
    return which


def tree(seed):
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((64, 16)).astype(np.float32), "b": rng.standard_normal(5)}


def exact(a, b):
    return all(np.array_equal(np.asarray(a[k]), np.asarray(b[k])) for k in b)


def test_a_late_first_metadata_never_uncommits_a_committed_save(proxied):
    """The first object a step's save writes (an array's metadata: on S3 and GCS no
    uncommitted group metadata is written before the commit) lands after the commit."""
    url, options, proxy, direct = proxied
    zarrckpt.save_checkpoint(url, 1, tree(1), storage_options=options)
    proxy.once(LATE, writes("run/0000000002/b/zarr.json"))
    zarrckpt.save_checkpoint(url, 2, tree(2), storage_options=options)  # its first attempt abandoned, retried
    proxy.settle()  # the abandoned attempt lands now, after the commit
    assert proxy.injected == {"write": 1}
    assert zarrckpt.all_steps(url, storage_options=direct) == [1, 2]
    assert exact(zarrckpt.load_checkpoint(url, 2, tree(0), storage_options=direct), tree(2))


def test_a_commit_that_failed_never_lands_late(proxied):
    url, options, proxy, direct = proxied
    zarrckpt.save_checkpoint(url, 1, tree(1), storage_options=options)
    proxy.once(LATE, writes("run/0000000002/zarr.json", committing=True), times=10)  # every try
    with pytest.raises(zarrckpt.CheckpointWriteError, match="nothing was committed"):
        zarrckpt.save_checkpoint(url, 2, tree(2), storage_options=options)
    proxy.settle()  # both tries land now
    assert proxy.injected["write"] >= 2
    assert zarrckpt.all_steps(url, storage_options=direct) == [1]
    proxy.fault = None
    zarrckpt.save_checkpoint(url, 2, tree(3), storage_options=options)  # the step can be saved again
    assert exact(zarrckpt.load_checkpoint(url, 2, tree(0), storage_options=direct), tree(3))


def test_a_late_chunk_of_an_overwritten_save_never_mixes_into_the_next(proxied):
    url, options, proxy, direct = proxied
    proxy.once(LATE, writes("run/w/c.0.0"))
    zarrckpt.save_pytree(url, tree(1), storage_options=options, max_chunk_bytes=1024)  # the chunk retried
    proxy.fault = None
    zarrckpt.save_pytree(url, tree(2), storage_options=options, max_chunk_bytes=1024, overwrite=True)
    proxy.settle()  # save 1's first attempt at the chunk lands now, on save 2's
    assert proxy.injected == {"write": 1}
    assert exact(zarrckpt.load_pytree(url, tree(0), storage_options=direct), tree(2))


def test_a_late_object_of_an_overwritten_copy_never_mixes_into_the_next(proxied):
    url, options, proxy, direct = proxied
    for name, seed in (("a", 1), ("b", 2)):
        zarrckpt.save_pytree(f"{url}-{name}", tree(seed), storage_options=direct, max_chunk_bytes=1024)
    proxy.once(LATE, writes("run-copy/w/c.0.0"))
    zarrckpt.copy_checkpoint(f"{url}-a", f"{url}-copy", src_storage_options=options, dst_storage_options=options)
    proxy.fault = None
    zarrckpt.copy_checkpoint(f"{url}-b", f"{url}-copy", src_storage_options=options, dst_storage_options=options,
                             overwrite=True)
    proxy.settle()
    assert proxy.injected == {"write": 1}
    assert exact(zarrckpt.load_pytree(f"{url}-copy", tree(0), storage_options=direct), tree(2))


@pytest.mark.parametrize("lands_s", [0.8 * DEADLINE_S, 4 * DEADLINE_S], ids=["before-the-retry", "after-it"])
def test_a_late_claim_of_the_lease_is_known_as_its_own(proxied, lands_s):
    """The lease's creation abandoned and tried again: landed before the retry, the retry
    finds it and reads it back as its own; landed after, it fails on arrival. Either
    way the manager holds the run."""
    url, options, proxy, direct = proxied
    proxy.once(Late(lands_s), writes("run/zarrckpt.leases/0000000001"))
    with zarrckpt.CheckpointManager(url, storage_options=options, heartbeat_s=0.2) as mgr:
        mgr.save(1, tree(1))
    proxy.settle()
    assert proxy.injected == {"write": 1}
    assert exact(zarrckpt.load_checkpoint(url, 1, tree(0), storage_options=direct), tree(1))


def test_a_late_commit_of_a_step_retention_deleted_never_reads_as_values(proxied):
    """Step 1's first commit request is abandoned and lands after retention deleted the
    step (a delete cannot be made conditional on what lands later). The newest step is
    untouched; step 1 reads as damaged, never as values; the next retention deletes it."""
    url, options, proxy, direct = proxied
    proxy.once(Late(600), writes("run/0000000001/zarr.json", committing=True))  # held until `settle`
    with zarrckpt.CheckpointManager(url, storage_options=options, keep_last=1, max_chunk_bytes=1024) as mgr:
        mgr.save(1, tree(1))  # committed by the retry
        mgr.save(2, tree(2))  # retention deletes step 1
        mgr.wait()
        assert zarrckpt.all_steps(url, storage_options=direct) == [2]
        proxy.settle()  # step 1's abandoned commit lands now, on a deleted step
        assert proxy.injected == {"write": 1}
        assert zarrckpt.all_steps(url, storage_options=direct) == [1, 2]  # step 1 back, whole only in name
        assert exact(zarrckpt.load_checkpoint_if_it_exists(url, tree(0), storage_options=direct)[0], tree(2))
        assert not zarrckpt.verify(f"{url}/0000000001", storage_options=direct).ok
        with pytest.raises(zarrckpt.CheckpointCorruptError):
            zarrckpt.load_checkpoint(url, 1, tree(0), storage_options=direct)
        mgr.save(3, tree(3))
    assert zarrckpt.all_steps(url, storage_options=direct) == [3]
    assert exact(zarrckpt.load_checkpoint(url, 3, tree(0), storage_options=direct), tree(3))


def test_an_overwrite_takes_a_late_request_of_the_save_it_replaces_for_one_and_commits(proxied):
    """Where no lease guards the place (`save_pytree`), an object found where the save
    creates one, not its own, is a request of an earlier save there that landed late:
    the first save's abandoned write of a chunk lands just as the overwriting save makes
    that chunk, and is deleted, the chunk made again, the save committed with its own
    values (the fencing of a manager's run must not fail such a save)."""
    url, options, proxy, direct = proxied
    proxy.once(LATE, writes("run/w/c.0.0"))
    zarrckpt.save_pytree(url, tree(1), storage_options=options, max_chunk_bytes=1024)  # the chunk retried
    landed = []

    def land_first(kind, method, target, body):
        if kind == "write" and ("run/w/c.0.0" in target or b"run/w/c.0.0" in body) and not landed:
            landed.append(1)
            proxy.settle()  # save 1's abandoned request lands now, before save 2's create
        return None

    proxy.fault = land_first
    zarrckpt.save_pytree(url, tree(2), storage_options=options, max_chunk_bytes=1024, overwrite=True)
    assert landed
    assert exact(zarrckpt.load_pytree(url, tree(0), storage_options=direct), tree(2))
