"""A FIFO, a socket or a device where a file should be, on every path that reads a
local file: opening a FIFO for reading waits for a writer forever (and Ctrl-C cannot
end a wait on a worker thread), reading /dev/zero never ends. Each is refused, or
skipped as damage, within seconds, naming the file."""

from __future__ import annotations

import logging
import re
import threading
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
from test_cli import run

import zarrckpt

KINDS = ["fifo", "socket", "device"]
NOT_A_FILE = "is (a FIFO|a socket|a device)"


def within_seconds(call, seconds: float = 20):
    """Runs `call` on a thread; fails the test if it has not returned in `seconds` (a
    wait on a FIFO would block it forever). Returns what it raised, or None."""
    outcome: list = []

    def target():
        try:
            call()
            outcome.append(None)
        except BaseException as e:
            outcome.append(e)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still blocked after {seconds} s"
    return outcome[0]


def steps(run_dir: Path, count: int) -> None:
    for step in range(1, count + 1):
        zarrckpt.save_checkpoint(str(run_dir), step, {"w": np.full(4, step, np.float32)})


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("where", ["zarr.json", "chunk"])
def test_load_of_a_checkpoint_holding_a_special_file_is_damage_named(tmp_path, special_file, kind, where):
    zarrckpt.save_pytree(str(tmp_path / "ck"), {"w": np.arange(4.0)})
    ck = tmp_path / "ck"
    special_file(ck / "zarr.json" if where == "zarr.json" else next((ck / "w").glob("c*")), kind)
    error = within_seconds(lambda: zarrckpt.load_pytree(str(tmp_path / "ck")))
    assert isinstance(error, zarrckpt.CheckpointCorruptError), error
    assert re.search(NOT_A_FILE, str(error)), error


@pytest.mark.parametrize("kind", KINDS)
def test_restore_skips_a_newest_step_whose_metadata_is_a_special_file(tmp_path, special_file, kind, caplog):
    steps(tmp_path / "run", 2)
    special_file(tmp_path / "run" / "0000000002" / "zarr.json", kind)
    with caplog.at_level(logging.WARNING, logger="zarrckpt"):
        def restore():
            with zarrckpt.CheckpointManager(str(tmp_path / "run")) as mgr:
                state, step = mgr.restore({"w": np.zeros(4, np.float32)})
                assert step == 1 and state["w"].tolist() == [1.0] * 4
        assert within_seconds(restore) is None
    assert any(re.search("0000000002/zarr.json " + NOT_A_FILE, r.getMessage()) for r in caplog.records)


@pytest.mark.parametrize("kind", KINDS)
def test_ls_of_a_run_with_a_special_file_as_a_steps_metadata_lists_the_rest(tmp_path, special_file, kind):
    steps(tmp_path / "run", 2)
    special_file(tmp_path / "run" / "0000000002" / "zarr.json", kind)
    done = run("ls", str(tmp_path / "run"))
    assert done.returncode == 0, done.stderr
    assert re.search(r"^ +1 +committed", done.stdout, re.M) and re.search(NOT_A_FILE, done.stderr)


@pytest.mark.parametrize("kind", KINDS)
def test_a_special_file_in_the_leases_is_a_dead_jobs_lease(tmp_path, special_file, kind):
    steps(tmp_path / "run", 1)
    (tmp_path / "run" / "zarrckpt.leases").mkdir()
    special_file(tmp_path / "run" / "zarrckpt.leases" / "0000000001", kind)

    def manage():
        with zarrckpt.CheckpointManager(str(tmp_path / "run"), heartbeat_s=0.2) as mgr:
            mgr.save(2, {"w": np.full(4, 2, np.float32)})
    assert within_seconds(manage) is None
    assert zarrckpt.all_steps(str(tmp_path / "run")) == [1, 2]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("where", ["file", "index", "shard"])
def test_safetensors_load_and_import_refuse_a_special_file(tmp_path, special_file, kind, where):
    tensors = {"a.w": np.arange(6, dtype=np.float32), "b": np.ones(2, np.float32)}
    if where == "file":
        src = tmp_path / "model.safetensors"
        special_file(src, kind)
    else:
        src = tmp_path / "set"
        src.mkdir()
        safetensors.numpy.save_file({"a.w": tensors["a.w"]}, src / "model-00001-of-00002.safetensors")
        safetensors.numpy.save_file({"b": tensors["b"]}, src / "model-00002-of-00002.safetensors")
        (src / "model.safetensors.index.json").write_text(
            '{"weight_map": {"a.w": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}')
        special_file(src / ("model.safetensors.index.json" if where == "index" else "model-00002-of-00002.safetensors"),
                kind)
    for call in (lambda: zarrckpt.load_safetensors(str(src)),
                 lambda: zarrckpt.import_checkpoint(str(src), str(tmp_path / "dst"))):
        error = within_seconds(call)
        assert isinstance(error, zarrckpt.CheckpointError), error
        assert re.search(NOT_A_FILE, str(error)), error
    assert not (tmp_path / "dst").exists()
