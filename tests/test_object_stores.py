"""What object stores add: requests issued concurrently, a constant number of round
trips to open a checkpoint or find the newest step, and store errors that are clear,
name the URL, commit nothing and never show a credential. Against the real S3 and GCS
servers of tests/object_store_servers.py, which count every request."""

import functools
import logging
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import pytest
from object_store_servers import TEST_KEY, TEST_SECRET, request_kinds

import zarrckpt
from zarrckpt import _commit, _storage
from zarrckpt._util import stats as _stats

both = pytest.mark.parametrize("store", ["s3", "gcs"], indirect=True)
UNCOMMITTED_GROUP = b'{"zarr_format": 3, "node_type": "group", "attributes": {}}'


def small_tree(leaves: int) -> dict:
    return {f"l{i}": np.full(4, i, np.float32) for i in range(leaves)}


def is_chunk(server, method: str, target: str) -> bool:
    """Whether a request reads or writes a chunk (`<leaf>/c.<i>`; `%2F` in a GCS path)."""
    return server.kind(method, target) in ("read", "write") and re.search(r"(/|%2F)c\.\d", target) is not None


@both
def test_requests_are_in_flight_together(store):
    """The server holds each chunk request until 32 are in flight at once: a save or
    restore that sent them fewer at a time would wait out the gathering's timeout and
    show a lower peak, however fast or slow this machine is."""
    recorder, tree = store.server.recorder, small_tree(96)
    peaks = []
    for run in (lambda: zarrckpt.save_pytree(store.url, tree, storage_options=store.options),
                lambda: zarrckpt.load_pytree(store.url, storage_options=store.options)):
        recorder.reset()
        hedged = _stats.snapshot().get("store_hedged_reads", 0)
        with recorder.gathered(32, functools.partial(is_chunk, store.server)):
            back = run()
        peaks.append(recorder.peak_in_flight)
        # Each chunk once; a read the gathering held long enough may be asked for again
        # (a hedged read: see zarrckpt._storage.hedge), counted as such (one given up on
        # before it went out never reaches the server). A request whose client gave up
        # on it (at its deadline, on a busy machine) is sent again: only the answer the
        # client waited for counts (object_store_servers.Call).
        chunks = [target for method, target in recorder.answered if is_chunk(store.server, method, target)]
        assert len(set(chunks)) == 96, recorder.requests
        assert len(chunks) - 96 <= _stats.snapshot().get("store_hedged_reads", 0) - hedged, recorder.requests
    assert all(np.array_equal(back[k], v) for k, v in tree.items())
    assert min(peaks) >= 32, peaks


@both
def test_opening_a_checkpoint_costs_one_request_whatever_its_size(store):
    server = store.server
    for leaves in (3, 60):
        url = f"{store.url}/{leaves}"
        zarrckpt.save_pytree(url, small_tree(leaves), storage_options=store.options)
        server.recorder.reset()
        meta = zarrckpt.metadata(url, storage_options=store.options)
        assert len(meta.leaves) == leaves and request_kinds(server) == {"read": 1}
        server.recorder.reset()
        hedged = _stats.snapshot().get("store_hedged_reads", 0)
        zarrckpt.load_pytree(url, storage_options=store.options)
        # The group's metadata, one chunk per leaf, then the first bytes of the group's
        # metadata again: still the same save (nothing read comes from two saves); and a
        # second request for any read much slower than the others (zarrckpt._storage.hedge).
        kinds = request_kinds(server)
        hedged = _stats.snapshot().get("store_hedged_reads", 0) - hedged
        assert set(kinds) == {"read"} and 1 + leaves + 1 <= kinds["read"] <= 1 + leaves + 1 + hedged, kinds


@both
def test_save_requests(store):
    """One write per object (every array's metadata and chunk, and the group's metadata
    once, at the commit: no uncommitted one before it on S3 and GCS, see `_commit`), and
    a constant number of other requests (finding what is there beforehand). A request
    the client gave up on and sent again (its deadline passed on a busy machine) counts
    once: `request_kinds` counts the answers the client waited for."""
    server = store.server
    others = []
    for leaves in (5, 40):
        server.recorder.reset()
        zarrckpt.save_pytree(f"{store.url}/{leaves}", small_tree(leaves), storage_options=store.options)
        kinds = request_kinds(server)
        assert kinds.pop("write") == leaves + leaves + 1, (server.recorder.answered, server.recorder.abandoned)
        others.append(kinds)
    assert others[0] == others[1] and sum(others[0].values()) <= 8, others


@both
def test_listing_steps_reads_newest_first_and_stops_at_the_first_committed(store):
    server, opts = store.server, store.options
    for step in (1, 2, 3):
        zarrckpt.save_checkpoint(store.url, step, small_tree(2), storage_options=opts)
    _storage.resolve(store.url, opts).step(3).write("zarr.json", UNCOMMITTED_GROUP)  # a crashed save
    server.recorder.reset()
    assert zarrckpt.latest_step(store.url, storage_options=opts) == 2
    assert request_kinds(server) == {"list": 1, "read": 2}
    server.recorder.reset()
    assert zarrckpt.all_steps(store.url, storage_options=opts) == [1, 2]
    assert request_kinds(server) == {"list": 1, "read": 3}


@both
def test_missing_bucket_is_a_clear_error(store):
    url = f"{store.server.protocol}://zarrckpt-no-such-bucket/run"
    with pytest.raises(zarrckpt.CheckpointWriteError) as info:
        zarrckpt.save_pytree(url, small_tree(2), storage_options=store.options)
    message = str(info.value)
    # The first object a save writes there is an array's metadata (see `_commit`).
    assert re.search(rf"cannot write {re.escape(url)}/l\d/\S+: the bucket does not exist", message), message
    assert "nothing was committed" in message
    for call in (zarrckpt.latest_step, zarrckpt.all_steps):  # a wrong URL, not a run yet to start
        with pytest.raises(zarrckpt.CheckpointLocationError, match="the bucket 'zarrckpt-no-such-bucket' does not "
                                                                   "exist"):
            call(url, storage_options=store.options)
    assert zarrckpt.latest_step(f"{store.url}/not-yet", storage_options=store.options) is None  # bucket there
    with pytest.raises(zarrckpt.CheckpointNotFoundError, match=f"no checkpoint at {url}"):
        zarrckpt.load_pytree(url, storage_options=store.options)


def everything_shown(error: BaseException) -> str:
    """An exception as a traceback prints it, its whole chain included."""
    return "".join(traceback.format_exception(error))


def test_access_denied_mid_save_commits_nothing(s3_server, new_store, caplog):
    """Credentials that may write metadata but no chunk: the save fails naming the
    chunk's URL, commits nothing (no group metadata at all: on S3 it is written once, at
    the commit), and shows no credential."""
    caplog.set_level(logging.DEBUG)
    store = new_store("s3")
    bucket = store.url.split("/")[2]
    key, secret = s3_server.new_user([
        {"Effect": "Allow", "Action": ["s3:GetObject", "s3:ListBucket"], "Resource": "*"},
        {"Effect": "Allow", "Action": ["s3:PutObject"], "Resource": f"arn:aws:s3:::{bucket}/*zarr.json"},
    ])
    caplog.clear()  # IAM's own answer, which carries the new secret, is logged at DEBUG
    with s3_server.enforcing_auth(), pytest.raises(zarrckpt.CheckpointWriteError) as info:
        zarrckpt.save_pytree(store.url, {"w": np.ones(3)}, storage_options=s3_server.options(key, secret))
    message = str(info.value)
    assert f"cannot write {store.url}/w/c.0: access denied" in message and "nothing was committed" in message
    assert _commit.head(_storage.resolve(store.url, store.options)).state is _commit.State.ABSENT
    shown = everything_shown(info.value) + caplog.text
    assert secret not in shown and key not in message


def test_credentials_never_appear(s3_server, new_store, caplog):
    """Not in logs (every library's, at DEBUG), exceptions, reprs, or the checkpoint."""
    caplog.set_level(logging.DEBUG)
    store = new_store("s3")
    zarrckpt.save_checkpoint(store.url, 1, small_tree(3), storage_options=store.options)
    zarrckpt.load_checkpoint_if_it_exists(store.url, small_tree(3), storage_options=store.options)
    zarrckpt.metadata(_storage.resolve(store.url, store.options).step(1).url, storage_options=store.options)
    with pytest.raises(zarrckpt.CheckpointWriteError) as missing:
        zarrckpt.save_pytree("s3://zarrckpt-no-such-bucket/x", small_tree(1), storage_options=store.options)
    with s3_server.enforcing_auth(), pytest.raises(zarrckpt.CheckpointWriteError) as refused:
        zarrckpt.save_checkpoint(store.url, 2, small_tree(1), storage_options=store.options)
    assert "access denied" in str(refused.value)
    shown = everything_shown(missing.value) + everything_shown(refused.value) + caplog.text
    shown += repr(_storage.resolve(store.url, store.options))
    assert TEST_SECRET not in shown
    ours = [r.getMessage() for r in caplog.records if r.name.startswith("zarrckpt")]
    assert ours and not any(TEST_KEY in m or TEST_SECRET in m for m in ours)
    fs = _storage.resolve(store.url, store.options).store.fs
    stored = fs.cat(fs.find(store.url))
    assert stored and not any(TEST_SECRET.encode() in data or TEST_KEY.encode() in data for data in stored.values())


def test_an_error_quoting_a_credential_is_redacted(monkeypatch):
    """Should a client library ever quote a credential, zarrckpt's message shows '***'
    instead, and the original exception is dropped rather than chained."""
    secret = "hunter2-zarrckpt-credential"
    options = {"client_kwargs": {"aws_secret_access_key": secret}, "token": {"private_key": secret + "-pk"}}
    url = "memory://zarrckpt-tests/redacted"
    fs = _storage.resolve(url, options).store.fs

    def refuse(path, data, **kwargs):
        raise PermissionError(f"denied for {secret} with {secret}-pk")

    monkeypatch.setattr(fs, "pipe_file", refuse)
    with pytest.raises(zarrckpt.CheckpointWriteError) as info:
        zarrckpt.save_pytree(url, small_tree(1), storage_options=options)
    shown = everything_shown(info.value)
    assert secret not in shown and "denied for *** with ***" in shown
    assert f"cannot write {url}/zarr.json: access denied" in str(info.value)

    def fail(path, data, **kwargs):
        raise OSError("the disk is on fire")

    monkeypatch.setattr(fs, "pipe_file", fail)
    with pytest.raises(zarrckpt.CheckpointWriteError) as info:
        zarrckpt.save_pytree(url, small_tree(1), storage_options=options)
    assert "The above exception was the direct cause" in everything_shown(info.value)  # kept for debugging


@pytest.mark.parametrize(("options", "within_s"), [
    # The user's own botocore timeouts of 2 s: a try ends there (or at zarrckpt's own
    # deadline, 20 s, where the client's read timeout never fires: a stalled PUT's first
    # try, in about half the runs here), and no layer of retries multiplies another's
    # (the bound the issue set: 60 s with default options).
    ({"config_kwargs": {"read_timeout": 2, "connect_timeout": 2}}, 60),
    # No client timeout under a minute: zarrckpt's own deadline abandons each try.
    ({"request_timeout_s": 2}, 2 * 2 + 10),
], ids=["client timeouts", "request_timeout_s"])
def test_a_store_that_stops_answering_fails_the_save_in_time_and_the_next_save_commits(
        s3_server, new_store, options, within_s):
    store = new_store("s3")
    given = {**store.options, **options}
    silent = s3_server.recorder.stalled(lambda method, target: method == "PUT" and "/0000000001/l0/c" in target)
    with silent, pytest.raises(zarrckpt.CheckpointWriteError, match=r"/l0/c\.0: no answer in") as info:
        started = time.monotonic()
        try:
            zarrckpt.save_checkpoint(store.url, 1, small_tree(1), storage_options=given)
        finally:
            took = time.monotonic() - started
    assert took < within_s, f"the save took {took:.1f}s"
    assert "nothing was committed" in str(info.value)
    assert zarrckpt.all_steps(store.url, storage_options=given) == []
    zarrckpt.save_checkpoint(store.url, 2, small_tree(2), storage_options=given)
    assert zarrckpt.all_steps(store.url, storage_options=given) == [2]


def test_request_timeout_s_is_checked_where_it_is_given():
    for bad in (0, -1, "10", float("nan"), True):
        with pytest.raises(ValueError, match=r"storage_options\['request_timeout_s'\] must be a number of seconds"):
            zarrckpt.save_pytree("memory://zarrckpt-tests/t", small_tree(1), storage_options={"request_timeout_s": bad})


def test_default_concurrency_per_protocol(s3_server):
    assert _storage.resolve("/tmp/x").concurrency == _storage.LOCAL_CONCURRENCY
    assert _storage.resolve("memory://x").concurrency == _storage.remote.MEMORY.concurrency
    s3 = _storage.resolve("s3://b/x", s3_server.options())
    assert s3.concurrency == _storage.OBJECT_STORE_CONCURRENCY
    # botocore's own default (10 connections) would cap the requests in flight.
    assert s3.store.fs.connect().meta.config.max_pool_connections >= s3.concurrency
    limited = _storage.resolve("s3://b/x", {**s3_server.options(), "config_kwargs": {"max_pool_connections": 5}})
    assert limited.store.fs.connect().meta.config.max_pool_connections == 5


def test_retries_are_zarrckpts_alone_unless_the_user_sets_the_clients(s3_server):
    s3 = _storage.resolve("s3://b/x", s3_server.options())
    assert s3.store.fs.retries == 1  # s3fs: one try
    assert s3.store.fs.connect().meta.config.retries["total_max_attempts"] == 1  # botocore: one attempt
    own = {"mode": "standard", "max_attempts": 10}
    theirs = _storage.resolve("s3://b/y", {**s3_server.options(), "config_kwargs": {"retries": own}})
    config = theirs.store.fs.connect().meta.config
    assert config.retries == own and config.max_pool_connections >= theirs.concurrency  # theirs, whole


def test_latency_benchmark_runs(tmp_path):
    """The benchmark's small settings, so that it keeps working."""
    script = Path(__file__).parent.parent / "benchmarks" / "object_store_latency.py"
    done = subprocess.run([sys.executable, str(script), "--leaves", "40", "--size-mib", "4", "--latency-ms", "5",
                           "--json", str(tmp_path / "out.json")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "restore" in done.stdout and "ideal" in done.stdout
