"""`zarrckpt import` of an Orbax run whose steps are `Composite`s (written by
orbax-checkpoint itself): the state, the JsonSave config, grain's iterator position and
the metrics `best_fn` ranks all come over, so that a zarrckpt manager continues the run
from one tree and `keep_best` ranks the imported steps; JSON files that are not what
Orbax writes are refused naming the file."""

from __future__ import annotations

import json
import re
from pathlib import Path

import grain
import grain.checkpoint
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from forked_cli import run
from test_import import assert_same_state, train_state, zeros_like

import zarrckpt
from zarrckpt._foreign import orbax_items as _items

LOSSES = {1: 0.5, 2: 0.25, 3: 0.75}  # step 2 is the best, not the newest
CONFIG = {"lr": 3e-4, "model": {"layers": 4, "name": "v1.2"}, "tags": ["a", None], "seed": 2**40}


def loader() -> grain.DataLoader:
    return grain.DataLoader(data_source=grain.sources.RangeDataSource(0, 64, 1),
                            sampler=grain.samplers.IndexSampler(64, shuffle=True, seed=3, num_epochs=1),
                            worker_count=0)


def composite_run(path: Path) -> tuple[dict[int, dict], dict[int, int]]:
    """An Orbax run of Composites (state, config, a grain DataLoader's position) with
    metrics ranked by `best_fn`; the states saved and the element each step's iterator
    gives next, by step."""
    states, following = {}, {}
    batches = iter(loader())
    options = ocp.CheckpointManagerOptions(best_fn=lambda m: m["loss"], best_mode="min", max_to_keep=3)
    with ocp.CheckpointManager(str(path), options=options, item_names=("state", "config", "dataset")) as mgr:
        for step in LOSSES:
            for _ in range(step * 3):
                next(batches)
            states[step] = train_state(step)
            mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(states[step]),
                                                   config=ocp.args.JsonSave(CONFIG),
                                                   dataset=grain.checkpoint.CheckpointSave(batches)),
                     metrics={"loss": LOSSES[step], "tokens": step * 1000})
            mgr.wait_until_finished()
            copy = iter(loader())  # the next element, leaving `batches` where it was
            copy.set_state(batches.get_state())
            following[step] = int(next(copy))
    return states, following


def test_an_imported_composite_run_continues_from_one_tree_and_keep_best_ranks_its_steps(tmp_path):
    states, following = composite_run(tmp_path / "orbax")
    for step in LOSSES:
        imported = run("import", str(tmp_path / "orbax"), str(tmp_path / "run"), "--step", str(step))
        assert imported.returncode == 0, imported.stderr
        assert "left out" not in imported.stdout
    with zarrckpt.CheckpointManager(str(tmp_path / "run"), keep_best=2, best_metric="loss", best_mode="min") as mgr:
        assert mgr.best_step() == 2
        assert mgr.metrics(3) == {"loss": 0.75, "tokens": 3000}
        for step in LOSSES:
            target = {"state": zeros_like(states[step]), "config": "", "dataset": zarrckpt.PerProcess(None)}
            restored, _ = mgr.restore(target, step=step)
            assert_same_state(restored["state"], states[step])
            assert json.loads(restored["config"]) == CONFIG
            batches = iter(loader())
            batches.set_state(json.dumps(restored["dataset"].value).encode())
            assert int(next(batches)) == following[step]
        mgr.save(4, states[3], metrics={"loss": 0.9})
    assert zarrckpt.all_steps(str(tmp_path / "run")) == [1, 2, 4]  # the two best and the newest


def test_a_dataset_iterators_position_resumes_as_zarrckpt_saves_one(tmp_path):
    batches = iter(grain.MapDataset.range(100).shuffle(seed=0).batch(4))
    for _ in range(5):
        next(batches)
    with ocp.CheckpointManager(str(tmp_path / "orbax"), item_names=("state", "data")) as mgr:
        mgr.save(7, args=ocp.args.Composite(state=ocp.args.StandardSave({"w": jnp.arange(3.0)}),
                                            data=grain.checkpoint.CheckpointSave(batches)))
        mgr.wait_until_finished()
    result = zarrckpt.import_checkpoint(str(tmp_path / "orbax"), str(tmp_path / "run"), prefix="train")
    restored = zarrckpt.load_pytree(result.url, {"train": {"state": {"w": np.zeros(3, np.float32)},
                                                           "data": zarrckpt.PerProcess(None)}})
    fresh = iter(grain.MapDataset.range(100).shuffle(seed=0).batch(4))
    fresh.set_state(restored["train"]["data"].value)
    assert next(fresh).tolist() == next(batches).tolist()


def test_import_prefix_and_export_select_keep_working_on_a_composite(tmp_path):
    composite_run(tmp_path / "orbax")
    imported = run("import", str(tmp_path / "orbax"), str(tmp_path / "run"), "--prefix", "orbax")
    assert imported.returncode == 0, imported.stderr
    exported = run("export", str(tmp_path / "run" / "0000000003"), str(tmp_path / "state.npz"),
                   "--select", "orbax.state.params")
    assert exported.returncode == 0, exported.stderr
    with np.load(tmp_path / "state.npz") as npz:
        assert sorted(npz.files) == ["dense.bias", "dense.kernel", "embed"]
    back = zarrckpt.load_pytree(str(tmp_path / "run" / "0000000003"))
    assert sorted(back["orbax"]) == ["config", "dataset", "state"]
    with zarrckpt.CheckpointManager(str(tmp_path / "run")) as mgr:
        assert mgr.metrics(3)["loss"] == 0.75


def small_composite(path: Path, metrics: dict | None = None) -> Path:
    options = ocp.CheckpointManagerOptions(best_fn=lambda m: m["loss"])
    with ocp.CheckpointManager(str(path), options=options, item_names=("state", "config")) as mgr:
        mgr.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave({"w": jnp.ones(2)}),
                                            config=ocp.args.JsonSave({"a": 1})), metrics=metrics)
        mgr.wait_until_finished()
    return path / "1"


@pytest.mark.parametrize("where, damage, why", [("config/metadata", b"{not json", "is not JSON"),
                                                ("metrics/metrics", b"[1,", "is not JSON"),
                                                ("config/metadata", '"a"'.encode("utf-16"), "is not UTF-8"),
                                                ("config/metadata", b" " * 9000 + b"{}", "is larger than")])
def test_json_that_is_not_what_orbax_writes_is_refused_naming_the_file(tmp_path, monkeypatch, where, damage, why):
    step = small_composite(tmp_path / "orbax", metrics={"loss": 1.0})
    (step / where).write_bytes(damage)
    monkeypatch.setattr(_items, "MAX_JSON", 8192)  # more than the state's _METADATA holds
    with pytest.raises(zarrckpt.CheckpointCorruptError, match=re.escape(f"{step / where} {why}")):
        zarrckpt.import_checkpoint(str(tmp_path / "orbax"), str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_metrics_that_are_no_numbers_are_left_out_and_non_finite_ones_kept_as_a_manager_keeps_them(tmp_path):
    step = small_composite(tmp_path / "orbax", metrics={"loss": 1.0})
    (step / "metrics" / "metrics").write_text('{"loss": NaN, "acc": 0.5, "note": "x", "best": true}')
    result = zarrckpt.import_checkpoint(str(tmp_path / "orbax"), str(tmp_path / "run"))
    assert sorted(result.skipped) == ["metrics.best", "metrics.note"]
    with zarrckpt.CheckpointManager(str(tmp_path / "run")) as mgr:
        assert mgr.metrics(1) == {"loss": "NaN", "acc": 0.5}


def test_grain_positions_of_several_processes_are_left_out_saying_why(tmp_path):
    step = small_composite(tmp_path / "orbax")
    (step / "dataset").mkdir()
    for i in range(2):
        (step / "dataset" / f"process_{i}-of-2.json").write_text('{"next_index": 3}')
    result = zarrckpt.import_checkpoint(str(tmp_path / "orbax"), str(tmp_path / "run"))
    assert "2 processes" in result.skipped["dataset"]
    (step / "dataset" / "process_1-of-2.json").unlink()
    with pytest.raises(zarrckpt.CheckpointCorruptError, match="one per process"):
        zarrckpt.import_checkpoint(str(tmp_path / "orbax"), str(tmp_path / "run2"))
