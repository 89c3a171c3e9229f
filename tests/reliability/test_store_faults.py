"""Real object stores answering as real ones do under load: 500s, 503 SlowDown, 429 and
dropped connections, on any kind of request, through a fault-injecting proxy
(tests/fault_proxy.py) in front of moto's S3 server and the GCS emulator.

At 30% of every request kind, at random, everything a user does completes with exact
data; at 100% it fails cleanly, within the deadline, with nothing committed, and the
next save works."""

import random
import time
import zlib

import jax.numpy as jnp
import numpy as np
import pytest
from fault_proxy import RESET, Answer, FaultProxy

import zarrckpt
from zarrckpt import _cli, _storage
from zarrckpt._util import stats as _stats

FAULTS = {"500": lambda rng: Answer(500), "503": lambda rng: Answer(503), "429": lambda rng: Answer(429),
          "reset": lambda rng: RESET}


@pytest.fixture(autouse=True)
def fast_backoff(monkeypatch):
    # The order of retries is what is tested, not their pace.
    monkeypatch.setattr(_storage.guard, "_FIRST_BACKOFF_S", 0.001)
    monkeypatch.setattr(_storage.guard, "_FIRST_THROTTLED_BACKOFF_S", 0.002)


@pytest.fixture(params=["s3", "gcs"])
def proxied(request):
    """A new bucket on a real store server, reached through a FaultProxy: the URL of a
    run in it, the storage options that go through the proxy, the proxy, and the
    options that reach the server directly (to check what it holds)."""
    server = request.getfixturevalue(f"{request.param}_server")
    proxy = FaultProxy(server.endpoint, "s3" if request.param == "s3" else "gs")
    url = f"{server.protocol}://{server.new_bucket()}/run"
    direct = {**server.options(), "request_timeout_s": 10}
    yield url, {**direct, "endpoint_url": proxy.endpoint}, proxy, direct
    proxy.stop()


def state(step):
    rng = np.random.default_rng(step)
    return {"w": rng.standard_normal((64, 32)).astype(np.float32), "b": rng.standard_normal(7), "step": step}


def exact(a, b):
    return all(np.array_equal(np.asarray(a[k]), np.asarray(b[k])) for k in ("w", "b", "step"))


@pytest.mark.parametrize("fault", FAULTS)
def test_a_third_of_every_request_kind_failing_is_absorbed(proxied, fault, capsys):
    url, options, proxy, direct = proxied
    proxy.at_random(0.3, FAULTS[fault], seed=zlib.crc32(fault.encode()))
    at_random, first = proxy.fault, set()

    def fault_each_kind_first(kind, method, target, body):  # so that every kind surely meets one
        if kind not in first:
            first.add(kind)
            return FAULTS[fault](None)
        return at_random(kind, method, target, body)

    proxy.fault = fault_each_kind_first
    frozen = jnp.arange(4096.0)  # the same array at every save: its chunks copied inside the store from step 2 on
    with zarrckpt.CheckpointManager(url, storage_options=options, keep_last=2, max_chunk_bytes=1024,
                                    heartbeat_s=0.2) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {**state(step), "frozen": frozen})
    assert zarrckpt.all_steps(url, storage_options=options) == [2, 3]
    target = {**state(0), "frozen": np.zeros(4096, np.float32)}
    np.testing.assert_array_equal(zarrckpt.load_checkpoint(url, 3, target, storage_options=direct)["frozen"],
                                  np.arange(4096.0))
    with zarrckpt.CheckpointManager(url, storage_options=options, heartbeat_s=0.2) as mgr:
        restored, step = mgr.restore(target)
    assert step == 3 and exact(restored, state(3))
    assert exact(zarrckpt.load_checkpoint(url, 2, target, storage_options=options), state(2))
    flags = [arg for key in ("endpoint_url", "key", "secret", "token") if key in options
             for arg in ("-o", f"{key}={options[key]}")]
    step_url = f"{url}/{2:010d}"
    for command in (["ls", url], ["info", step_url], ["verify", step_url], ["cp", step_url, f"{url}-copy"],
                    ["gc", url, "--keep-last", "1"]):
        assert _cli.main([*command, *flags]) == 0, (command, capsys.readouterr())
    assert zarrckpt.all_steps(url, storage_options=direct) == [3]
    assert exact(zarrckpt.load_pytree(f"{url}-copy", target, storage_options=direct), state(2))
    # The faults really happened, on every kind of request zarrckpt makes.
    assert {"read", "list", "write", "copy", "delete"} <= set(proxy.injected), (proxy.injected, proxy.seen)


@pytest.mark.parametrize("fault", FAULTS)
def test_every_request_failing_fails_cleanly_then_the_next_save_works(proxied, fault):
    url, options, proxy, direct = proxied
    zarrckpt.save_checkpoint(url, 1, state(1), storage_options=options)
    proxy.fault = lambda kind, method, target, body: FAULTS[fault](random)
    started = time.monotonic()
    with pytest.raises((zarrckpt.CheckpointWriteError, OSError)) as info:
        zarrckpt.save_checkpoint(url, 2, state(2), storage_options=options)
    assert time.monotonic() - started < 10  # tries, not deadlines: nothing here waits for an answer
    message = str(info.value)
    assert url.split("://")[1].split("/")[0] in message and "tries" in message
    if fault != "reset":
        assert f"HTTP {fault}" in message
    proxy.fault = None
    assert zarrckpt.all_steps(url, storage_options=direct) == [1]
    zarrckpt.save_checkpoint(url, 2, state(2), storage_options=options)
    assert exact(zarrckpt.load_checkpoint(url, 2, state(0), storage_options=direct), state(2))


def test_a_manager_s_failed_save_leaves_nothing_and_the_next_copies_the_unchanged_chunks(proxied):
    """Every try of the changing leaf's chunk answered 500, after the frozen leaf's chunks
    were copied: what the failed save made is deleted as soon as the failure is known
    (before: left in the bucket until a `gc`), and the next save copies the frozen leaf's
    chunks inside the store from the last committed step (before: it wrote them all)."""
    url, options, proxy, direct = proxied
    frozen = jnp.arange(2**20, dtype=jnp.float32)  # the very same array at every save

    def training(step):
        return {"frozen": frozen, "changing": jnp.full(1024, step, jnp.float32)}

    def changing_chunk_of_step_2(kind, method, target, body):  # S3's key is in the path, GCS's in the body
        key = "run/0000000002/changing/c"
        return Answer(500) if kind == "write" and (key in target or key.encode() in body) else None

    with zarrckpt.CheckpointManager(url, storage_options=options) as mgr:
        mgr.save(1, training(1))
        mgr.wait()
        proxy.fault = changing_chunk_of_step_2
        mgr.save(2, training(2))
        with pytest.raises(zarrckpt.CheckpointWriteError, match="HTTP 500"):
            mgr.wait()
        assert _storage.resolve(f"{url}/0000000002", direct).walk() == []
        proxy.fault = None
        _stats.reset()
        mgr.save(3, training(3))
        mgr.wait()
        counted = _stats.snapshot()
    assert counted.get("store_bytes_copied", 0) >= frozen.nbytes > counted.get("store_bytes_written", 0)
    assert zarrckpt.all_steps(url, storage_options=direct) == [1, 3]
    restored = zarrckpt.load_checkpoint(url, 3, storage_options=direct)
    np.testing.assert_array_equal(restored["frozen"], np.asarray(frozen))
    np.testing.assert_array_equal(restored["changing"], np.full(1024, 3, np.float32))
