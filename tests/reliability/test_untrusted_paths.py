"""Untrusted input on the paths that read a checkpoint besides load: retention (a
training job's own `keep_last`/`keep_best`), `zarrckpt gc`, a save that replaces a step,
and `zarrckpt export`. What a broken disk or a hostile writer leaves there is a warning
and left alone, never a failure of a training job's save and never the loss of the step
it should have kept."""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import tracemalloc
from pathlib import Path

import forked_cli
import numpy as np
import pytest

import zarrckpt
import zarrckpt._foreign.export
import zarrckpt._format.tree
from zarrckpt import _cli
from zarrckpt._run import retention as _retention
from zarrckpt._util import stats as _stats


def state(step: int) -> dict:
    return {"w": np.full((4, 3), step, np.float32), "step": step}


@pytest.mark.parametrize("mode", ["min", "max"])
def test_a_nan_or_non_number_in_stored_metrics_never_ranks_as_the_best(mode: str) -> None:
    # Read from storage, metrics can hold anything JSON can: a bare NaN, an infinity, a
    # string. Every order the steps can come in must rank the one finite best first.
    best, worse = (0.1, 0.5) if mode == "min" else (0.9, 0.5)
    policy = _retention.Policy(keep_best=1, best_metric="loss", best_mode=mode)
    scores = [best, worse, math.nan, -math.inf if mode == "min" else math.inf, "0.0"]
    for order in itertools.permutations(scores):
        metrics = {step: {"loss": score} for step, score in enumerate(order, 1)}
        ranked = _retention.ranked(policy, metrics)
        assert [metrics[s]["loss"] for s in ranked] == [best, worse], order


def test_a_bare_nan_in_a_stored_metric_never_deletes_the_best_step(tmp_path: Path) -> None:
    root = str(tmp_path)
    with zarrckpt.CheckpointManager(root) as mgr:  # keeps every step
        for step, loss in {1: 0.3, 2: 0.5, 3: 0.1}.items():
            mgr.save(step, state(step), metrics={"loss": loss}, force=True)
    # Step 2's metric edited on disk to a bare NaN (read by Python's json, not valid JSON).
    meta = tmp_path / "0000000002" / "zarr.json"
    text = meta.read_text()
    assert text.count('"loss":0.5') == 1
    meta.write_text(text.replace('"loss":0.5', '"loss":NaN'))
    assert zarrckpt.all_steps(root) == [1, 2, 3]  # still committed
    with zarrckpt.CheckpointManager(root, keep_best=1, best_metric="loss") as mgr:
        mgr.save(4, state(4), metrics={"loss": 0.6}, force=True)
    assert zarrckpt.all_steps(root) == [3, 4]  # the best, and the newest


def misshapen_step(root: Path, step: int) -> Path:
    """Step `step` of `root`, saved and then broken: a directory where its `zarr.json` was."""
    zarrckpt.save_checkpoint(str(root), step, state(step))
    meta = root / f"{step:010d}" / "zarr.json"
    meta.unlink()
    meta.mkdir()
    return meta.parent


def test_a_step_whose_group_metadata_is_a_directory_is_left_alone_by_retention(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = str(tmp_path)
    broken = misshapen_step(tmp_path, 1)
    with caplog.at_level(logging.WARNING, logger="zarrckpt"):
        with zarrckpt.CheckpointManager(root, keep_last=1) as mgr:
            for step in (2, 3, 4):  # every save's retention meets the broken step
                mgr.save(step, state(step), force=True)
                mgr.wait()
    assert zarrckpt.all_steps(root) == [4]
    assert broken.is_dir() and (broken / "zarr.json").is_dir() and (broken / "w").is_dir()
    warned = [r.getMessage() for r in caplog.records if "step 1 " in r.getMessage()]
    assert warned and all("not deleted" in line and "zarr.json/" in line for line in warned), warned


def test_gc_leaves_a_step_whose_group_metadata_is_a_directory_and_exits_0(tmp_path: Path) -> None:
    broken = misshapen_step(tmp_path, 1)
    there = sorted(os.listdir(broken))
    for step in (2, 3):
        zarrckpt.save_checkpoint(str(tmp_path), step, state(step))
    done = forked_cli.run("gc", str(tmp_path), "--keep-last", "1")
    assert done.returncode == 0, done.stderr
    assert "step 1 " in done.stderr and "zarr.json/" in done.stderr
    assert zarrckpt.all_steps(str(tmp_path)) == [3]
    assert sorted(os.listdir(broken)) == there and (broken / "zarr.json").is_dir()


def test_a_save_over_a_step_whose_group_metadata_is_a_directory_is_refused_naming_it(tmp_path: Path) -> None:
    broken = misshapen_step(tmp_path, 1)
    with pytest.raises(zarrckpt.CheckpointExistsError, match=r"0000000001 .*'zarr\.json/'"):
        zarrckpt.save_checkpoint(str(tmp_path), 1, state(1), overwrite=True)
    assert (broken / "zarr.json").is_dir() and (broken / "w").is_dir()


@pytest.mark.parametrize("out", ["x.npz", "x.safetensors"])
def test_export_never_writes_through_a_planted_partial_link(tmp_path: Path, out: str) -> None:
    zarrckpt.save_checkpoint(str(tmp_path / "run"), 1, state(1))
    victim = tmp_path / "victim"
    victim.write_bytes(b"someone's file")
    (tmp_path / f"{out}.partial").symlink_to(victim)  # the name the export used to write aside to
    result = zarrckpt._foreign.export.export_checkpoint(str(tmp_path / "run" / "0000000001"), str(tmp_path / out))
    assert victim.read_bytes() == b"someone's file"
    assert result.leaves == 2 and (tmp_path / out).is_file() and not (tmp_path / out).is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["run", "victim", out, f"{out}.partial"])


def test_export_refuses_an_existing_out_unless_told_to_replace_it(tmp_path: Path) -> None:
    url = str(tmp_path / "run" / "0000000001")
    zarrckpt.save_checkpoint(str(tmp_path / "run"), 1, state(1))
    out = tmp_path / "x.npz"
    out.write_bytes(b"an earlier export")
    with pytest.raises(FileExistsError, match=r"x\.npz already exists; pass overwrite=True"):
        zarrckpt._foreign.export.export_checkpoint(url, str(out))
    done = forked_cli.run("export", url, str(out))
    assert done.returncode == 1 and "x.npz already exists; pass --overwrite" in done.stderr, done.stderr
    assert out.read_bytes() == b"an earlier export"
    # A link at OUT is replaced itself, never written through.
    victim = tmp_path / "victim"
    victim.write_bytes(b"someone's file")
    out.unlink()
    out.symlink_to(victim)
    done = forked_cli.run("export", url, str(out), "--overwrite")
    assert done.returncode == 0, done.stderr
    assert victim.read_bytes() == b"someone's file" and not out.is_symlink()
    assert np.load(out)["w"].tolist() == state(1)["w"].tolist()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "victim", "x.npz"]


@pytest.mark.parametrize("inside", ["zarr.json", "w/c.0", "notes.npz", "w/x.safetensors"])
def test_export_never_writes_inside_the_checkpoint_it_exports(tmp_path: Path, inside: str) -> None:
    """An export's file over the commit marker or a chunk would lose or damage a
    committed step; a new one among its files would be what retention then never deletes."""
    zarrckpt.save_checkpoint(str(tmp_path / "run"), 1, state(1))
    step = tmp_path / "run" / "0000000001"
    before = {str(p.relative_to(step)): p.read_bytes() for p in sorted(step.rglob("*")) if p.is_file()}
    with pytest.raises(ValueError, match=str(step / inside)):
        zarrckpt._foreign.export.export_checkpoint(str(step), str(step / inside), format="npz",
                                           overwrite=True)
    done = forked_cli.run("export", str(step), str(step / inside), "--format", "npz", "--overwrite")
    assert done.returncode == 1 and str(step / inside) in done.stderr, done.stderr
    assert {str(p.relative_to(step)): p.read_bytes() for p in sorted(step.rglob("*")) if p.is_file()} == before
    assert zarrckpt.all_steps(str(tmp_path / "run")) == [1] and zarrckpt.verify(str(step)).ok


def nested(depth: int) -> dict:
    tree: dict = {"w": np.arange(3)}
    for _ in range(depth - 1):
        tree = {"a": tree}
    return tree


def deeper(frames: int, fn):
    """`fn()` called `frames` Python frames further down the stack."""
    return deeper(frames - 1, fn) if frames else fn()


def test_the_deepest_tree_save_accepts_loads_from_deep_in_the_stack(tmp_path: Path) -> None:
    url = str(tmp_path / "x")
    depth = zarrckpt._format.tree.MAX_DEPTH
    zarrckpt.save_pytree(url, nested(depth))
    back = deeper(700, lambda: zarrckpt.load_pytree(url))
    for _ in range(depth - 1):
        back = back["a"]
    assert back["w"].tolist() == [0, 1, 2]


@pytest.mark.parametrize("depth", [zarrckpt._format.tree.MAX_DEPTH + 1, 470, 1000, 3000])
def test_a_tree_too_deep_to_load_is_refused_at_save(tmp_path: Path, depth: int) -> None:
    root = str(tmp_path / "run")
    with zarrckpt.CheckpointManager(root) as mgr:
        with pytest.raises(zarrckpt.UnsupportedLeafError, match=r"nests deeper than 100 levels"):
            mgr.save(1, nested(depth))
        assert zarrckpt.all_steps(root) == [] and not (tmp_path / "run" / "0000000001").exists()
        assert mgr.save(2, state(2))  # the next save works
        mgr.wait()
    assert zarrckpt.all_steps(root) == [2]


# -- hostile metadata on every path that reads a checkpoint ---------------------------

def hostile(root: Path, step: int, edit) -> Path:
    """Step `step` under `root`, saved and then its metadata edited by `edit(document,
    record of leaf w, w's array metadata)`: a few hundred bytes, as an attacker writes them."""
    zarrckpt.save_checkpoint(str(root), step, {"w": np.zeros(4, np.uint8), "pos": zarrckpt.PerProcess(7)})
    path = root / f"{step:010d}" / "zarr.json"
    doc = json.loads(path.read_text())
    record = next(c for c in doc["attributes"]["zarrckpt"]["tree"]["children"] if c["name"] == "w")
    edit(doc, record, doc["consolidated_metadata"]["metadata"]["w"])
    path.write_text(json.dumps(doc, separators=(",", ":")))  # the commit marker stays first
    own = root / f"{step:010d}" / "w" / "zarr.json"
    own.write_text(json.dumps({**json.loads(own.read_text()), **doc["consolidated_metadata"]["metadata"]["w"]}))
    return path.parent


def grid(shape: list[int], chunks: list[int]):
    def edit(doc, record, array):
        record["shape"] = array["shape"] = shape
        array["chunk_grid"]["configuration"]["chunk_shape"] = chunks
    return edit


def processes(count: int):
    def edit(doc, record, array):
        next(c for c in doc["attributes"]["zarrckpt"]["tree"]["children"] if c["name"] == "pos")["processes"] = count
    return edit


def peak_bytes(call) -> tuple[int, object]:
    """What `call()` allocated at its peak (numpy's buffers included), and what it returned
    or raised."""
    tracemalloc.start()
    try:
        try:
            outcome = call()
        except Exception as e:  # noqa: BLE001  (the test judges it)
            outcome = e
        return tracemalloc.get_traced_memory()[1], outcome
    finally:
        tracemalloc.stop()


def retention(root: Path):
    with zarrckpt.CheckpointManager(str(root), keep_last=1) as mgr:
        mgr.save(9, state(9), force=True)
    return zarrckpt.all_steps(str(root))


PATHS = {
    "info": lambda root, step: zarrckpt.metadata(str(step)),
    "load": lambda root, step: zarrckpt.load_pytree(str(step)),
    "verify": lambda root, step: zarrckpt.verify(str(step)),
    "cp": lambda root, step: zarrckpt.copy_checkpoint(str(step), str(root.parent / "copy")),
    "overwrite": lambda root, step: zarrckpt.save_checkpoint(str(root), 1, state(1), overwrite=True),
    "gc": lambda root, step: _cli.main(["gc", str(root), "--keep-last", "1"]),
    "retention": lambda root, step: retention(root),
}
LIMIT = 64 * 2**20  # what any of these may allocate for a checkpoint of a few bytes


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("edit", [grid([2**40], [1]), grid([2**26 - 1], [1]), processes(2**20), processes(10**12)],
                         ids=["2**40 chunks", "2**26-1 chunks", "2**20 processes", "10**12 processes"])
def test_hostile_metadata_costs_what_is_stored_on_every_path(tmp_path: Path, path: str, edit) -> None:
    root = tmp_path / "run"
    step = hostile(root, 1, edit)
    zarrckpt.save_checkpoint(str(root), 2, state(2))
    _stats.reset()
    peak, outcome = peak_bytes(lambda: PATHS[path](root, step))
    requests = sum(n for name, n in _stats.snapshot().items() if name.startswith("store_") and "bytes" not in name)
    # A load allocates the leaf it is asked for, up to the machine's memory (2**26 - 1
    # bytes here): that is load's own limit, which every other path keeps too.
    assert peak < LIMIT + (2**26 if path == "load" else 0), f"{path} allocated {peak:,} bytes"
    assert requests < 100, f"{path} made {requests} requests of the store"  # not one per declared object
    if path == "info":  # refused cleanly, or described as the metadata says (no chunk is read)
        assert isinstance(outcome, (zarrckpt.CheckpointCorruptError, zarrckpt.CheckpointMetadata)), outcome
    elif path in ("load", "cp"):  # refused cleanly, naming what is wrong
        assert isinstance(outcome, (zarrckpt.CheckpointCorruptError, zarrckpt.CheckpointMismatchError)), outcome
        assert str(outcome) and not (root.parent / "copy").exists()  # nothing copied
    elif path == "verify":
        assert not outcome.ok and len(outcome.problems) <= 12, outcome.problems  # named, then counted
    elif path == "overwrite":  # an old broken step is replaced (its objects judged by their names)
        assert outcome is None and zarrckpt.load_pytree(str(step))["step"] == 1
    else:  # gc and retention delete it as an old step, like any other
        assert outcome in (0, [9]) and not step.exists(), outcome
