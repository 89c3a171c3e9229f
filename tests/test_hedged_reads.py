"""Hedged reads on object stores (zarrckpt._storage.hedge): a read slower than nearly
every read of its size gets a second request; the first good answer wins, the other
is cancelled, and the second requests stay within their share of the reads. Real S3
(moto) behind a proxy that holds, garbles or answers late the requests it is told to."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

import numpy as np
import pytest
from fault_proxy import Delay, FaultProxy, Garbled, Late

import zarrckpt
import zarrckpt._storage
import zarrckpt._util.concurrency
from zarrckpt._storage import hedge
from zarrckpt._util import stats as _stats

LEAVES = 64


@pytest.fixture
def any_slow_read_hedged(monkeypatch):
    """Every read may get a second request: on a busy machine ordinary reads are slow
    too, and those tests that follow one chosen read must not find the share spent."""
    monkeypatch.setattr(hedge, "SHARE", 1.0)
    monkeypatch.setattr(hedge, "_BURST", float(LEAVES))


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


def on_chunk_gets(log: list[str], choose):
    """A fault for the proxy: every chunk GET logged, then `choose(target)` says what
    happens to it (with the log as it is then)."""
    lock = threading.Lock()

    def decide(kind, method, target, body):
        if kind != "read" or "/c.0" not in target:
            return None
        with lock:
            log.append(target)
            return choose(target)

    return decide


def first_get_of(leaf: str, fault, log: list[str]):
    """A fault for the proxy: `fault` for the first GET of `leaf`'s chunk."""
    return on_chunk_gets(log, lambda target: fault if f"/{leaf}/" in target and chunk_gets(log, leaf) == 1
                         else None)


def restored_exactly(url: str, tree: dict, options: dict) -> None:
    back = zarrckpt.load_pytree(url, storage_options=options)
    for key, value in tree.items():
        assert np.array_equal(back[key], value), key


def test_a_read_that_never_answers_is_answered_by_its_second_request(proxied, any_slow_read_hedged):
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


@pytest.mark.parametrize("checksum", [True, False], ids=["the store's checksum sent", "no checksum sent"])
def test_a_hedge_whose_first_answer_arrives_damaged_takes_the_good_one(proxied, any_slow_read_hedged, checksum):
    """The first GET of a chunk answers late (2 s) and right; the second, sent as the
    first is slow, answers at once with a bit flipped: found by the client against S3's
    checksum of the object, or, where the store sends none, by the chunk's CRC-32C. The
    damaged answer is set aside, the right one taken, and the restore is exact, with no
    damage reported."""
    url, tree, options, proxy = proxied
    log: list[str] = []
    first = first_get_of("l50", Delay(2.0), log)

    def fault(kind, method, target, body):
        decided = first(kind, method, target, body)
        if decided is None and "/l50/c.0" in target and chunk_gets(log, "l50") == 2:
            return Garbled(keep_checksums=checksum)
        return decided

    proxy.fault = fault
    _stats.reset()
    restored_exactly(url, tree, options)
    assert chunk_gets(log, "l50") == 2, log
    assert chunk_gets(log) <= LEAVES + _stats.snapshot().get("store_hedged_reads", 0)
    assert proxy.injected["read"] == 2  # the delay and the garbling: both happened


def test_the_request_given_up_on_is_cancelled_and_leaves_nothing_behind(proxied, any_slow_read_hedged):
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
    """After three calm restores, the first GET of 11 of the 64 chunks answers late:
    each far slower than nearly every read the client has seen (11 of its latest 256),
    yet second requests go out for at most SHARE of this restore's reads plus what the
    reads before earned (`_BURST`), each counted; every chunk is read and right. Late
    means 2 s, or five times what the calm reads taught the client to wait if more: beside
    six busy processes they taught it 1.1-1.5 s, and beside the test suite in four
    processes a delay of 2 s got no second request."""
    url, tree, options, proxy = proxied
    for _ in range(3):
        restored_exactly(url, tree, options)
    taught = [d for h in list(hedge._CLIENTS.values()) if (d := h.delay(tree["l00"].nbytes)) is not None]
    late = max(2.0, 5 * max(taught))
    log: list[str] = []
    slow = {f"/l{i:02d}/c.0" for i in range(0, LEAVES, 6)}
    proxy.fault = on_chunk_gets(log, lambda target: Delay(late) if target.endswith(tuple(slow))
                                and log.count(target) == 1 else None)
    _stats.reset()
    restored_exactly(url, tree, options)
    hedged = _stats.snapshot().get("store_hedged_reads", 0)
    reads = _stats.snapshot()["store_read"]
    assert 1 <= hedged <= hedge.SHARE * reads + hedge._BURST and hedged < len(slow), (hedged, reads, late)
    assert LEAVES < len(log) <= LEAVES + hedged and len(set(log)) == LEAVES, log


def learnt() -> hedge.Hedging:
    """A client's history after 40 quick reads: a second request may go out after 50 ms."""
    hedging = hedge.Hedging()
    for _ in range(40):
        read = object()
        hedging.started(read, 0)
        hedging.ended(read, 0, 0.001)
    return hedging


def requests(*outcomes) -> tuple[list[concurrent.futures.Future], object]:
    """Futures standing for requests, in the order sent: an exception or bytes each, or
    None for one never answered; and a `start` that sends the next."""
    futures = []
    for outcome in outcomes:
        future: concurrent.futures.Future = concurrent.futures.Future()
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        elif outcome is not None:
            future.set_result(outcome)
        futures.append(future)
    sent = iter(futures)
    return futures, lambda: next(sent)


def test_a_second_answer_that_no_other_could_change_is_raised_at_once():
    """The first request hangs; the second finds the object gone: that is the answer
    (the read lost a race with retention), not a timeout 30 s later."""
    futures, start = requests(None, FileNotFoundError("gone"))
    with pytest.raises(FileNotFoundError):
        hedge.first_good(start, learnt(), nbytes=0, timeout=30, check=None)
    assert futures[0].cancelled()


def test_at_the_deadline_an_answer_in_hand_is_returned_even_a_wrong_one():
    """The first request hangs; the second answers wrong: at the deadline the caller gets
    that answer (its codec names the damage), not a timeout that throws it away."""
    futures, start = requests(None, b"wrong")
    assert hedge.first_good(start, learnt(), nbytes=0, timeout=0.5, check=lambda data: "damaged") == b"wrong"
    assert futures[0].cancelled()


def test_a_read_given_up_by_its_operation_cancels_its_requests_at_once():
    """A restore gives up a read another process has made for it (`_restore.relief`):
    the request still unanswered is cancelled then, not left holding a connection."""
    futures, start = requests(None)
    began = threading.Event()

    def read(_):
        began.set()
        return hedge.first_good(start, hedge.Hedging(), nbytes=0, timeout=30, check=None)

    with zarrckpt._util.concurrency.Operation(1, "test") as op:
        window = op.window([0], read, budget=zarrckpt._util.concurrency.ByteBudget(1), nbytes=lambda _: 1,
                           abandon=lambda _: began.is_set())
        assert [result for _, result, _ in window] == [zarrckpt._util.concurrency.ABANDONED]
    for _ in range(100):  # the request is cancelled on the reading thread, as it wakes
        if futures[0].cancelled():
            break
        time.sleep(0.01)
    assert futures[0].cancelled()


def test_a_read_given_up_cancels_the_requests_of_every_chunk_it_reads_at_once():
    """A box of chunks is read chunk by chunk at once (an operation inside the read):
    given up by the restore, each chunk's unanswered request is cancelled too."""
    futures = [concurrent.futures.Future(), concurrent.futures.Future()]  # never answered
    sent: list[int] = []

    def chunk(i):
        def start():
            sent.append(i)
            return futures[i]
        return hedge.first_good(start, hedge.Hedging(), nbytes=0, timeout=30, check=None)

    def read(_):
        return zarrckpt._util.concurrency.run_all(chunk, [0, 1], 2)

    with zarrckpt._util.concurrency.Operation(1, "test") as op:
        window = op.window([0], read, budget=zarrckpt._util.concurrency.ByteBudget(1), nbytes=lambda _: 1,
                           abandon=lambda _: len(sent) == 2)
        assert [result for _, result, _ in window] == [zarrckpt._util.concurrency.ABANDONED]
    for _ in range(200):  # each request is cancelled on its reading thread, as it wakes
        if all(f.cancelled() for f in futures):
            break
        time.sleep(0.01)
    assert all(f.cancelled() for f in futures)


def test_chunks_read_at_once_take_spare_bytes_from_the_restore_budget_and_stop_when_it_fails():
    """The chunks of one read share its restore's byte budget for second requests (a
    full budget spares nothing), and stop making requests once another read failed."""
    concurrency = zarrckpt._util.concurrency
    failed, inner_started = threading.Event(), threading.Barrier(3)  # the two chunks and the other read

    def chunk(i):
        spared = concurrency.spare(5)
        inner_started.wait()
        assert failed.wait(30)
        for _ in range(500):  # the outer operation's failure reaches this thread's requests
            if concurrency.aborted():
                return spared
            time.sleep(0.01)
        return "never aborted"

    def read(n):
        if n == 1:
            inner_started.wait()
            failed.set()
            raise OSError("the other read failed")
        return concurrency.run_all(chunk, [0, 1], 2)

    spared = []
    with pytest.raises(OSError, match="the other read failed"):
        with concurrency.Operation(2, "test") as op:
            for _, result, hold in op.window([0, 1], read, budget=concurrency.ByteBudget(10), nbytes=lambda n: 5):
                spared.append(result)
                hold.release()
    assert spared in ([], [[None, None]]), spared
