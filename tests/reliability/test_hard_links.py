"""A file linked into two steps, as a save that reuses an unchanged chunk links it: no
path that writes or deletes one step (a save over it, `overwrite=True`, a copy onto
it, an import, a deletion, `zarrckpt gc`) changes a byte the other step holds."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from test_cli import run

import zarrckpt
from zarrckpt import _storage


def files_of(step: Path) -> dict[str, bytes]:
    return {str(p.relative_to(step)): p.read_bytes() for p in sorted(step.rglob("*")) if p.is_file()}


def linked_step(run_dir: Path, src: int, dst: int, *, committed: bool = True) -> None:
    """Step `dst` made of hard links to every file of step `src` (without its group
    metadata, the commit, unless `committed`)."""
    for path in sorted((run_dir / f"{src:010d}").rglob("*")):
        target = run_dir / f"{dst:010d}" / path.relative_to(run_dir / f"{src:010d}")
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        elif committed or path.relative_to(run_dir / f"{src:010d}") != Path("zarr.json"):
            target.parent.mkdir(parents=True, exist_ok=True)
            os.link(path, target)


@pytest.mark.parametrize("how", ["in place", "atomic", "as a save's object"])
def test_a_write_over_a_file_linked_elsewhere_leaves_the_other_name_as_it_was(tmp_path, how):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "c").write_bytes(b"kept" * 1000)
    os.link(tmp_path / "a" / "c", tmp_path / "b" / "c")
    loc = _storage.resolve(str(tmp_path))
    if how == "as a save's object":
        loc.write_new("b/c", b"new")
    else:
        loc.write("b/c", b"new", atomic=how == "atomic", durable=True)
    assert (tmp_path / "a" / "c").read_bytes() == b"kept" * 1000
    assert (tmp_path / "b" / "c").read_bytes() == b"new"
    assert (tmp_path / "a" / "c").stat().st_nlink == 1


def test_a_write_over_a_file_of_its_own_still_replaces_all_of_it(tmp_path):
    """The file is emptied first, not written over its start: a shorter write leaves
    no tail of the longer file it replaced."""
    (tmp_path / "c").write_bytes(b"x" * 1000)
    _storage.resolve(str(tmp_path)).write("c", b"short", durable=True)
    assert (tmp_path / "c").read_bytes() == b"short"


def state(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((64, 32)).astype(np.float32), "b": rng.standard_normal(32), "step": seed}


@pytest.mark.parametrize("path", ["save with overwrite", "save over uncommitted", "copy onto it", "import onto it",
                                  "manager delete", "gc"])
def test_every_path_that_writes_or_deletes_a_step_leaves_a_step_sharing_its_files_as_it_was(tmp_path, path):
    import safetensors.numpy

    run_dir = tmp_path / "run"
    zarrckpt.save_checkpoint(str(run_dir), 1, state(1))
    before = files_of(run_dir / "0000000001")
    other = 0 if path == "gc" else 2  # gc keeps the newest step: the linked one is older
    linked_step(run_dir, 1, other, committed=path != "save over uncommitted")
    if path == "save with overwrite":
        zarrckpt.save_checkpoint(str(run_dir), 2, state(2), overwrite=True)
    elif path == "save over uncommitted":
        zarrckpt.save_checkpoint(str(run_dir), 2, state(2))
    elif path == "copy onto it":
        zarrckpt.save_pytree(str(tmp_path / "other"), state(2))
        zarrckpt.copy_checkpoint(str(tmp_path / "other"), str(run_dir / "0000000002"), overwrite=True)
    elif path == "import onto it":
        safetensors.numpy.save_file({"w": state(2)["w"]}, str(tmp_path / "model.safetensors"))
        zarrckpt.import_checkpoint(str(tmp_path / "model.safetensors"), str(run_dir), step=2, overwrite=True)
    elif path == "manager delete":
        with zarrckpt.CheckpointManager(str(run_dir)) as manager:
            manager.delete(2)
    else:
        assert run("gc", str(run_dir), "--keep-last", "1").returncode == 0
    if path in ("save with overwrite", "save over uncommitted", "copy onto it"):
        restored = zarrckpt.load_checkpoint(str(run_dir), 2, state(0))
        assert np.array_equal(restored["w"], state(2)["w"]) and restored["step"] == 2
    elif path in ("manager delete", "gc"):
        assert not (run_dir / f"{other:010d}").exists()
    assert files_of(run_dir / "0000000001") == before
    assert zarrckpt.verify(str(run_dir / "0000000001")).ok
    restored = zarrckpt.load_checkpoint(str(run_dir), 1, state(0))
    assert all(np.array_equal(restored[k], v) for k, v in state(1).items())
