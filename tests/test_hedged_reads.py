"""Hedged reads on object stores (zarrckpt._storage.hedge): a read slower than nearly
every read of its size gets a second request; the first good answer wins, the other
is cancelled, and the second requests stay within their share of the reads. Real S3
(moto) behind a proxy that holds, garbles or answers late the requests it is told to."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
from fault_proxy import Delay, FaultProxy, Garbled, Late

import zarrckpt
from zarrckpt import _stats
from zarrckpt._storage import hedge

LEAVES = 64


@pytest.fixture
def proxied(s3_server):
    """A bucket holding a checkpoint of LEAVES chunks, and the storage options that
    reach it through a fault proxy (every test's clients start with no read history:
    conftest.fresh_read_history)."""
    bucket = s3_server.new_bucket()
    url = f"s3://{bucket}/ckpt"
    tree = {f"l{i:02d}": np.full(2**14, i, np.float32) for i in range(LEAVES)}  # 64 KiB chunks
    zarrckpt.save_pytree(url, tree, storage_options=s3_server.options())
    proxy = FaultProxy(s3_server.endpoint, "s3")
    try:
        yield url, tree, {**s3_server.options(), "endpoint_url": proxy.endpoint}, proxy
    finally:
        proxy.stop()


def chunk_gets(proxy_log: list[str], leaf: str | None = None) -> int:
    return sum(1 for target in proxy_log if "/c.0" in target and (leaf is None or f"/{leaf}/" in target))


def first_get_of(leaf: str, fault, log: list[str]):
    """A fault for the proxy: `fault` for the first GET of `leaf`'s chunk; every chunk
    GET logged."""
    lock = threading.Lock()

    def decide(kind, method, target, body):
        if kind != "read" or "/c.0" not in target:
            return None
        with lock:
            log.append(target)
            first = chunk_gets(log, leaf) == 1 and f"/{leaf}/" in target
        return fault if first else None

    return decide


def restored_exactly(url: str, tree: dict, options: dict) -> None:
    back = zarrckpt.load_pytree(url, storage_options=options)
    for key, value in tree.items():
        assert np.array_equal(back[key], value), key


def test_a_read_that_never_answers_is_answered_by_its_second_request(proxied):
    """The first GET of one chunk is never answered: without a second request the read
    would wait for its deadline (20 s) and be made again; with one, the restore takes
    the second's answer, the read counted as hedged once and never retried."""
    url, tree, options, proxy = proxied
    _stats.reset()
    restored_exactly(url, tree, options)
    reads = _stats.snapshot()["store_read"]  # a restore's reads, none tried again
    log: list[str] = []
    proxy.fault = first_get_of("l40", Late(60), log)
    _stats.reset()
    restored_exactly(url, tree, options)
    hedged = _stats.snapshot().get("store_hedged_reads", 0)
    # Each chunk read; none asked for a third time; a second request given up on before
    # it went out never reaches the store.
    assert chunk_gets(log, "l40") == 2 and LEAVES + 1 <= chunk_gets(log) <= LEAVES + hedged, log
    assert len(set(log)) == LEAVES and all(log.count(t) <= 2 for t in log), log
    assert _stats.snapshot()["store_read"] == reads  # the read was never made again after a deadline


def test_a_hedge_whose_first_answer_arrives_damaged_takes_the_good_one(proxied):
    """The first GET of a chunk answers late (2 s) and right; the second, sent as the
    first is slow, answers at once with a bit flipped: the damaged answer is kept aside,
    the right one taken, and the restore is exact, with no damage reported."""
    url, tree, options, proxy = proxied
    log: list[str] = []
    first = first_get_of("l50", Delay(2.0), log)

    def fault(kind, method, target, body):
        decided = first(kind, method, target, body)
        if decided is None and "/l50/c.0" in target and chunk_gets(log, "l50") == 2:
            return Garbled()
        return decided

    proxy.fault = fault
    _stats.reset()
    restored_exactly(url, tree, options)
    assert chunk_gets(log, "l50") == 2, log
    assert chunk_gets(log) <= LEAVES + _stats.snapshot().get("store_hedged_reads", 0)
    assert proxy.injected["read"] == 2  # the delay and the garbling: both happened


def test_the_request_given_up_on_is_cancelled_and_leaves_nothing_behind(proxied):
    url, tree, options, proxy = proxied
    log: list[str] = []
    proxy.fault = first_get_of("l10", Late(60), log)
    restored_exactly(url, tree, options)
    fs = zarrckpt._storage.resolve(url, options).store.fs

    async def reads_in_flight() -> list[asyncio.Task]:
        return [task for task in asyncio.all_tasks() if "_cat_file" in getattr(task.get_coro(), "__qualname__", "")]

    for _ in range(100):  # a cancellation lands at the loop's next turn
        left = asyncio.run_coroutine_threadsafe(reads_in_flight(), fs.loop).result()
        if not left:
            break
        time.sleep(0.01)
    assert left == []
    assert not [t for t in threading.enumerate() if t.name.startswith("zarrckpt-")]


def test_second_requests_stay_within_their_share_of_the_reads(proxied):
    """Every chunk's first GET after the first 24 answers 2 s late: all of them are far
    slower than the reads before, yet at most SHARE of the reads get a second request,
    each counted; every chunk is read and right."""
    url, tree, options, proxy = proxied
    log: list[str] = []
    lock = threading.Lock()

    def fault(kind, method, target, body):
        if kind != "read" or "/c.0" not in target:
            return None
        with lock:
            log.append(target)
            late = len(log) > 24 and sum(1 for t in log if t == target) == 1
        return Delay(2.0) if late else None

    proxy.fault = fault
    _stats.reset()
    restored_exactly(url, tree, options)
    hedged = _stats.snapshot().get("store_hedged_reads", 0)
    reads = _stats.snapshot()["store_read"]
    assert 1 <= hedged <= hedge.SHARE * reads, (hedged, reads)  # a new client: nothing earned before
    assert LEAVES < len(log) <= LEAVES + hedged and len(set(log)) == LEAVES, log
