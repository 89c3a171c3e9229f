"""A sparse 1 GiB file where zarrckpt reads a small object whole (a step's or an
array's `zarr.json`, a lease, a pin): read no further than its cap (docs/reliability.md),
it costs a clear error naming it, or the step it is in skipped as not committed, never
its size in memory.

Each case runs in a process of its own, which makes the same call on an untouched copy
of the run first (imports, JAX's start, the first save's compilation), then on the one
with the planted file, and reports how far its peak resident memory (the kernel's
high-water mark, which sees every read) rose in between.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import resource
import shutil
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from fault_proxy import Answer, FaultProxy
from forked_cli import environment

import zarrckpt
from zarrckpt import _cli, _storage
from zarrckpt._run import retention as _retention

HUGE = 1 << 30
MORE = 100 << 20  # the most a planted file may add to a process's peak memory


def state(step: int) -> dict:
    return {"w": np.full(16, step, np.float32)}


# What each case does with a run directory, in the measuring process; returns what
# the test checks (JSON).
def latest_step(run: str) -> object:
    return zarrckpt.latest_step(run)


def ls(run: str) -> object:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = _cli.main(["ls", run])
    return {"status": status, "out": out.getvalue(), "err": err.getvalue()}


def restore(run: str) -> object:
    with zarrckpt.CheckpointManager(run, heartbeat_s=0.2) as mgr:
        restored, step = mgr.restore(state(0))
        assert restored["w"][0] == step
        return step


def retention(run: str) -> object:
    with zarrckpt.CheckpointManager(run, keep_last=1, heartbeat_s=0.2) as mgr:
        mgr.save(3, state(3))
    return zarrckpt.all_steps(run)


def verify(run: str) -> object:
    report = zarrckpt.verify(f"{run}/0000000002")
    return {"ok": report.ok, "problems": [[p.key, p.message] for p in report.problems]}


def measure(case: str, clean: str, hostile: str) -> dict:
    """Runs `case` on `clean`, then on `hostile`: what it returned or raised there, what
    it logged, and how far the peak memory rose (bytes)."""
    logged: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("zarrckpt").addHandler(handler)
    call = globals()[case]
    call(clean)
    logged.clear()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        outcome = {"returned": call(hostile)}
    except Exception as e:
        outcome = {"raised": type(e).__name__, "message": str(e)}
    grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024  # KiB on Linux
    return {**outcome, "logged": logged, "grew": grew}


@pytest.fixture
def runs(tmp_path):
    """Two copies of a run of steps 1 and 2 (step 1 pinned, where a case asks), and a
    function that plants a sparse 1 GiB file in the second at a path and measures a case."""
    clean = tmp_path / "clean"
    for step in (1, 2):
        zarrckpt.save_checkpoint(str(clean), step, state(step))
    hostile = tmp_path / "hostile"

    def plant_and_measure(where: str, case: str) -> dict:
        shutil.copytree(clean, hostile)
        path = hostile / where
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            f.write(b"{")  # a JSON document that does not end
            os.truncate(f.fileno(), HUGE)
        done = subprocess.run([sys.executable, __file__, case, str(clean), str(hostile)], capture_output=True,
                              text=True, timeout=600,
                              env=environment({"PYTHONPATH": str(Path(__file__).parents[1])}))
        assert done.returncode == 0, done.stderr
        found = json.loads(done.stdout.splitlines()[-1])
        assert found["grew"] < MORE, f"{case} with a 1 GiB {where}: peak memory rose {found['grew'] >> 20} MiB"
        return found

    return plant_and_measure


STEP_METADATA = "0000000002/zarr.json"
CAPPED = "larger than 64 MiB, the most zarrckpt reads"


def test_latest_step_skips_a_step_whose_metadata_is_huge_unread(runs):
    found = runs(STEP_METADATA, "latest_step")
    assert found["returned"] == 1
    assert any(STEP_METADATA in m and CAPPED in m and "not committed" in m for m in found["logged"]), found


def test_ls_lists_the_rest_beside_a_step_whose_metadata_is_huge_unread(runs):
    found = runs(STEP_METADATA, "ls")
    listed = found["returned"]
    assert listed["status"] == 0, found
    lines = listed["out"].splitlines()
    assert any(line.split()[:2] == ["1", "committed"] for line in lines), found
    assert any(line.split()[:2] == ["2", "uncommitted"] for line in lines), found
    assert any(STEP_METADATA in m and CAPPED in m for m in found["logged"]), found


def test_retention_deletes_a_step_whose_metadata_is_huge_as_a_leftover_unread(runs):
    assert runs(STEP_METADATA, "retention")["returned"] == [3]


def test_a_manager_resumes_from_the_step_before_one_whose_metadata_is_huge_unread(runs):
    assert runs(STEP_METADATA, "restore")["returned"] == 1


def test_verify_reports_a_huge_step_metadata_unread(runs):
    found = runs(STEP_METADATA, "verify")["returned"]
    assert not found["ok"]
    assert any(STEP_METADATA in message and CAPPED in message for _, message in found["problems"]), found


def test_verify_reports_a_huge_array_metadata_unread(runs):
    found = runs("0000000002/w/zarr.json", "verify")["returned"]
    assert not found["ok"]
    assert ["w/zarr.json", "larger than 1 MiB, the most zarrckpt reads of such an object (see docs/reliability.md): "
            "not read"] in found["problems"], found


@pytest.mark.parametrize("case", ["restore", "retention"])
def test_a_huge_lease_is_a_dead_jobs_lease_unread(runs, case):
    found = runs("zarrckpt.leases/0000000001", case)
    assert found["returned"] == (2 if case == "restore" else [3]), found
    assert any("zarrckpt.leases/0000000001 is larger than 1 MiB" in m and "not alive" in m
               for m in found["logged"]), found


def test_retention_keeps_a_step_pinned_by_a_huge_pin_unread(runs):
    assert runs("0000000001/PINNED", "retention")["returned"] == [1, 3]


def test_ls_shows_a_step_pinned_by_a_huge_pin_unread(runs):
    found = runs("0000000001/PINNED", "ls")["returned"]
    assert found["status"] == 0, found
    assert any(line.split()[:3] == ["1", "committed", "pinned"] for line in found["out"].splitlines()), found


def test_every_store_reads_no_further_than_a_cap_and_names_the_object(store):
    loc = _storage.resolve(store.url, store.options)
    loc.write("big", b"x" * (8 << 20))
    loc.write("fits", b"x" * _storage.SMALL_BYTES)
    loc.write("empty", b"")  # a range of it is refused by S3 (HTTP 416)
    tracemalloc.start()  # what this process holds (the test servers' own memory too)
    try:
        with pytest.raises(_storage.TooLarge, match=re.escape(f"{store.url}/big is larger than 1 MiB")):
            loc.read("big")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert store.server is not None or peak < 4 << 20, f"reading past the cap: {peak >> 20} MiB held"
    assert len(loc.read("fits")) == _storage.SMALL_BYTES and loc.read("empty") == b""
    assert loc.read_if_present(["empty", "absent"], cap=0) == [b"", None]
    with pytest.raises(_storage.TooLarge, match="fits is larger than 0 bytes"):
        loc.read("fits", cap=0)


def test_a_pin_and_an_empty_step_metadata_read_as_such_on_every_store(store, caplog):
    for step in (1, 2):
        zarrckpt.save_checkpoint(store.url, step, state(step), storage_options=store.options)
    root = _storage.resolve(store.url, store.options)
    assert _retention.pin(root.step(1)) and _retention.is_pinned(root.step(1))
    assert not _retention.is_pinned(root.step(2))
    root.step(2).write("zarr.json", b"")
    with caplog.at_level(logging.WARNING, logger="zarrckpt"):
        assert zarrckpt.latest_step(store.url, storage_options=store.options) == 1
    assert any("0000000002/zarr.json is not a JSON object" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_an_object_store_is_asked_for_no_more_than_the_cap(request, kind):
    """One ranged GET of the cap and a byte; a range of an empty object refused (HTTP
    416, as S3 and GCS answer; the GCS emulator does not) reads as empty."""
    server = request.getfixturevalue(f"{kind}_server")
    proxy = FaultProxy(server.endpoint, "s3" if kind == "s3" else "gs")
    seen: list[tuple[str, str]] = []

    def fault(what: str, method: str, target: str, body: bytes) -> Answer | None:
        seen.append((what, target))
        return Answer(416) if what == "ranged" and "empty" in target else None

    try:
        loc = _storage.resolve(f"{server.protocol}://{server.new_bucket()}/run",
                               {**server.options(), "endpoint_url": proxy.endpoint})
        loc.write("big", b"x" * (8 << 20))
        loc.write("empty", b"")
        proxy.fault = fault
        with pytest.raises(_storage.TooLarge, match="big is larger than 1 MiB"):
            loc.read("big")
        assert [what for what, _ in seen] == ["ranged"], seen
        assert loc.read("empty") == b"" and loc.read_if_present(["empty"], cap=0) == [b""]
    finally:
        proxy.stop()


if __name__ == "__main__":
    print(json.dumps(measure(*sys.argv[1:])))


def test_a_save_whose_metadata_no_reader_would_read_is_refused_before_its_commit(tmp_path, monkeypatch):
    """A checkpoint's metadata larger than the cap a reader reads would commit a step
    that no restore can open (a restore would start over from the state given, and
    retention would delete the steps before it): the commit is refused, naming the
    size and the cap, and nothing is committed. The cap is lowered here: a real 64 MiB
    document takes some 90,000 leaves."""
    from zarrckpt import _commit

    monkeypatch.setattr(_commit, "GROUP_BYTES", 16 * 1024)
    url = str(tmp_path / "ck")
    with pytest.raises(zarrckpt.CheckpointWriteError, match=r"metadata would be [\d,]+ bytes, more than the 16,384"):
        zarrckpt.save_pytree(url, {f"leaf_{i:03d}": np.ones(2) for i in range(100)})
    with pytest.raises(zarrckpt.CheckpointNotFoundError):
        zarrckpt.load_pytree(url)
