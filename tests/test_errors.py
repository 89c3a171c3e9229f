"""Bad input: each gets a clear error naming the leaf, URL or step, and nothing committed changes."""

import itertools
import json
import logging
import os
import re
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import zarr
from test_cli import run

import zarrckpt


def edit_group_attributes(url: Path, edit) -> None:
    doc = json.loads((url / "zarr.json").read_text())
    edit(doc["attributes"])
    (url / "zarr.json").write_text(json.dumps(doc))


@pytest.mark.parametrize("leaf, what", [
    (bytearray(b"mutable"), "builtins.bytearray"),  # str and bytes are leaves since issue 10; bytearray is not
    (object(), "builtins.object"),
    (np.array(["x"]), "dtype <U1 cannot be saved"),
    (np.array([object()], dtype=object), "dtype object cannot be saved"),
    (2**70, "Python int 1180591620717411303424 does not fit in int64"),
])
def test_unsupported_leaf_names_its_key_path(tmp_path, leaf, what):
    with pytest.raises(zarrckpt.UnsupportedLeafError, match=r"\['opt'\]\[1\]") as info:
        zarrckpt.save_pytree(str(tmp_path / "c"), {"opt": [1, leaf]})
    assert what in str(info.value)
    assert not (tmp_path / "c").exists()


def test_unsupported_dict_keys(tmp_path):
    with pytest.raises(zarrckpt.UnsupportedLeafError, match=r"dict key \(1, 2\) of type tuple at \['a'\]"):
        zarrckpt.save_pytree(str(tmp_path / "c"), {"a": {(1, 2): 1}})
    with pytest.raises(zarrckpt.UnsupportedLeafError, match="cannot flatten the tree at <root>"):
        zarrckpt.save_pytree(str(tmp_path / "c"), {1: 1, "1": 2})


def test_saving_over_a_committed_checkpoint(tmp_path):
    url = str(tmp_path / "c")
    zarrckpt.save_pytree(url, {"a": np.ones(2)})
    with pytest.raises(zarrckpt.CheckpointExistsError, match=f"{url} already holds a committed checkpoint; "
                                                             "pass overwrite=True"):
        zarrckpt.save_pytree(url, {"a": np.zeros(2)})
    np.testing.assert_array_equal(zarrckpt.load_pytree(url)["a"], np.ones(2))
    zarrckpt.save_pytree(url, {"b": np.zeros(3)}, overwrite=True)
    assert list(zarrckpt.load_pytree(url)) == ["b"]
    assert not (Path(url) / "a").exists()


@pytest.mark.parametrize("cut_short", ["a save before its commit", "a deletion after its marker",
                                       "a deletion that emptied an array's directory"])
def test_leftover_uncommitted_directory_is_replaced(tmp_path, cut_short):
    url = tmp_path / "c"
    zarrckpt.save_pytree(str(url), {"stale": np.ones(3), "gone": np.ones(2)})  # arrays the new tree does not have
    if cut_short == "a save before its commit":
        edit_group_attributes(url, lambda attrs: attrs.pop("write_completed"))
    else:
        (url / "zarr.json").unlink()
    if cut_short == "a deletion that emptied an array's directory":
        for path in (url / "gone").iterdir():
            path.unlink()
    zarrckpt.save_pytree(str(url), {"a": np.ones(2)})
    assert not (url / "stale").exists()
    np.testing.assert_array_equal(zarrckpt.load_pytree(str(url))["a"], np.ones(2))


def everything_in(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): None if p.is_dir() else p.read_bytes() for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("made_by", ["zarr v3", "zarr v2", "a camera"])
def test_someone_s_zarr_group_or_numbered_files_are_never_taken_for_a_leftover(tmp_path, made_by):
    """A place holding a zarr group that zarrckpt did not write, or files whose names a
    leftover of seqax's layout could have, is refused by a save, a copy and an import;
    a zarr v3 group is left alone by retention where it has a step's name too."""
    data = tmp_path / "data"
    if made_by == "a camera":
        for camera, frame in itertools.product(range(2), range(3)):
            (data / f"cam{camera}").mkdir(parents=True, exist_ok=True)
            (data / f"cam{camera}" / str(frame)).write_bytes(bytes([camera, frame]))
    else:
        group = zarr.open_group(str(data), mode="w", zarr_format=3 if made_by == "zarr v3" else 2)
        group.create_array("temperature", shape=(4, 4), chunks=(2, 2), dtype="f4")[:] = np.arange(16.0).reshape(4, 4)
    before = everything_in(data)
    zarrckpt.save_pytree(str(tmp_path / "src"), {"w": np.ones(3)})
    safetensors.numpy.save_file({"w": np.ones(3, np.float32)}, str(tmp_path / "model.safetensors"))
    for attempt in (lambda: zarrckpt.save_pytree(str(data), {"w": np.ones(3)}),
                    lambda: zarrckpt.copy_checkpoint(str(tmp_path / "src"), str(data)),
                    lambda: zarrckpt.import_checkpoint(str(tmp_path / "model.safetensors"), str(data))):
        with pytest.raises(zarrckpt.CheckpointExistsError, match=re.escape(str(data))):
            attempt()
        assert everything_in(data) == before
    if made_by != "zarr v3":  # in a run's step, zarr v2 names are seqax's (see test_seqax.py)
        return
    (tmp_path / "run").mkdir()
    data.rename(tmp_path / "run" / "0000000001")  # older than the newest committed step: a leftover's place
    with zarrckpt.CheckpointManager(str(tmp_path / "run"), keep_last=1, async_save=False) as mgr:
        for step in (2, 3):
            mgr.save(step, {"w": np.full(3, step)})
    assert zarrckpt.all_steps(str(tmp_path / "run")) == [3]
    assert everything_in(tmp_path / "run" / "0000000001") == before


@pytest.mark.parametrize("zarr_format", [3, 2])
def test_a_zarr_group_of_someone_s_given_as_a_run_is_named_for_what_it_is(tmp_path, zarr_format):
    """`all_steps`, a manager and `zarrckpt ls` on a zarr group that zarrckpt did not
    write refuse it (ls: no steps), naming its URL and never sending the user to
    load_pytree, which cannot load it; a checkpoint itself is still named so."""
    data = tmp_path / "data"
    zarr.open_group(str(data), mode="w", zarr_format=zarr_format).create_array("t", shape=(2,), dtype="f4")[:] = 1
    for attempt in (lambda: zarrckpt.all_steps(str(data)), lambda: zarrckpt.CheckpointManager(str(data))):
        with pytest.raises(zarrckpt.CheckpointLocationError) as raised:
            attempt()
        assert str(data) in str(raised.value) and "load_pytree" not in str(raised.value)
    listed = run("ls", str(data))
    assert listed.returncode == 0 and str(data) in listed.stdout and "zarrckpt info" not in listed.stdout
    zarrckpt.save_pytree(str(tmp_path / "ckpt"), {"w": np.ones(2)})
    with pytest.raises(zarrckpt.CheckpointLocationError, match="load_pytree"):
        zarrckpt.all_steps(str(tmp_path / "ckpt"))
    assert "zarrckpt info" in run("ls", str(tmp_path / "ckpt")).stdout


def test_a_step_that_is_a_symbolic_link_is_named_as_the_link(tmp_path, caplog):
    """A run's step directory that is a link to a checkpoint elsewhere is never followed,
    and the warning names the step directory as the link (not its zarr.json)."""
    zarrckpt.save_pytree(str(tmp_path / "elsewhere"), {"w": np.ones(2)})
    zarrckpt.save_checkpoint(str(tmp_path / "run"), 1, {"w": np.zeros(2)})
    (tmp_path / "run" / "0000000004").symlink_to(tmp_path / "elsewhere")
    with caplog.at_level(logging.WARNING, logger="zarrckpt"), pytest.raises(zarrckpt.CheckpointNotFoundError):
        zarrckpt.load_checkpoint(str(tmp_path / "run"), 4)
    link = f"{tmp_path / 'run' / '0000000004'} is a symbolic link"
    assert any(link in record.getMessage() for record in caplog.records), [r.getMessage() for r in caplog.records]


def test_someone_s_empty_directories_are_neither_a_leftover_nor_part_of_a_checkpoint(tmp_path):
    """Empty directories a save never makes are someone's: a directory holding only them
    is refused by a save, and one inside a committed step stops an overwrite=True save
    (naming it), as a file there would."""
    for name, folders in (("project", ["data/raw", "results"]), ("flat", ["data", "logs", "results"])):
        project = tmp_path / name
        for folder in folders:
            (project / folder).mkdir(parents=True)
        before = everything_in(project)
        with pytest.raises(zarrckpt.CheckpointExistsError, match=re.escape(str(project)) + ".*'data/'"):
            zarrckpt.save_pytree(str(project), {"w": np.ones(3)})
        assert everything_in(project) == before
    run_dir = tmp_path / "run"
    zarrckpt.save_checkpoint(str(run_dir), 6, {"w": np.ones(3)})
    (run_dir / "0000000006" / "notes").mkdir()
    before = everything_in(run_dir)
    with pytest.raises(zarrckpt.CheckpointExistsError, match="'notes/'"):
        zarrckpt.save_checkpoint(str(run_dir), 6, {"w": np.zeros(3)}, overwrite=True)
    assert everything_in(run_dir) == before


def test_saving_over_something_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "notes.txt").write_text("precious")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "x.csv").write_text("1,2")
    with pytest.raises(zarrckpt.CheckpointExistsError,
                       match=r"is not empty and not a checkpoint \(it holds 'data/', 'notes.txt'\); refusing"):
        zarrckpt.save_pytree(str(tmp_path), {"a": np.ones(2)})
    assert (tmp_path / "notes.txt").read_text() == "precious"


def test_loading_what_is_not_there_or_not_committed(tmp_path):
    url = tmp_path / "c"
    with pytest.raises(zarrckpt.CheckpointNotFoundError, match=f"no checkpoint at {url}"):
        zarrckpt.load_pytree(str(url))
    zarrckpt.save_pytree(str(url), {"a": np.ones(2)})
    edit_group_attributes(url, lambda attrs: attrs.pop("write_completed"))
    with pytest.raises(zarrckpt.CheckpointNotFoundError, match="is not committed"):
        zarrckpt.load_pytree(str(url))


def test_loading_a_checkpoint_directory_says_what_to_do(tmp_path):
    zarrckpt.save_checkpoint(str(tmp_path), 3, {"a": 1})
    with pytest.raises(zarrckpt.CheckpointNotFoundError,
                       match=f"no checkpoint at {tmp_path} \\(it is a directory of steps: give one step's "
                             f"URL, the newest {tmp_path}/0000000003\\)"):
        zarrckpt.load_pytree(str(tmp_path))


def test_missing_chunk_is_an_error_not_zeros(tmp_path):
    url = tmp_path / "c"
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
    x = jax.device_put(jnp.zeros((8, 8)), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("a")))
    zarrckpt.save_pytree(str(url), {"w": x}, min_chunk_bytes=1)
    os.remove(url / "w" / "c.1.0")
    with pytest.raises(zarrckpt.CheckpointCorruptError, match=r"chunk 'w/c.1.0' is missing from checkpoint") as e:
        zarrckpt.load_pytree(str(url))
    notes = "\n".join(getattr(e.value, "__notes__", []))
    assert "leaf ['w']" in notes
    assert f"`zarrckpt verify {url}` lists every damaged object; restore an earlier step" in notes  # what to do


def test_a_step_named_without_its_padding_is_pointed_at(tmp_path):
    zarrckpt.save_checkpoint(str(tmp_path / "run1"), 8, {"a": 1})
    for given in ("8", "08"):
        pointed = f"no checkpoint at {tmp_path}/run1/{given} \\(step 8 is {tmp_path}/run1/0000000008\\)"
        with pytest.raises(zarrckpt.CheckpointNotFoundError, match=pointed):
            zarrckpt.load_pytree(str(tmp_path / "run1" / given))
    with pytest.raises(zarrckpt.CheckpointNotFoundError, match=r"no checkpoint at \S+/run1/9$"):  # no such step
        zarrckpt.metadata(str(tmp_path / "run1" / "9"))


def test_mismatch_lists_every_problem_before_reading(tmp_path, monkeypatch):
    url = str(tmp_path / "c")
    zarrckpt.save_pytree(url, {"a": np.ones((2, 3), np.float32), "b": np.ones(4, np.int32),
                               "c": np.ones(2), "extra": 1})
    target = {"a": np.zeros((3, 2), np.float32), "b": np.zeros(4, np.float32), "c": np.zeros(2),
              "missing": np.zeros(1)}
    live = jnp.ones(3)
    with pytest.raises(zarrckpt.CheckpointMismatchError) as info:
        zarrckpt.load_pytree(url, {**target, "live_is_not_freed": live})
    message = str(info.value)
    assert "5 problem(s)" in message
    for line in ["['a']: shape (2, 3) in the checkpoint, (3, 2) in the target",
                 "['b']: dtype int32 in the checkpoint, float32 in the target",
                 "['missing']: in the target but not in the checkpoint",
                 "['extra']: in the checkpoint but not in the target"]:
        assert line in message
    assert not live.is_deleted()



def test_mismatch_of_a_renamed_subtree_is_one_line_per_side_with_what_helps(tmp_path):
    """A top-level key renamed over 300 leaves: one line on each side with its leaf count,
    the two names said to hold the same key paths, and no partial=True (it cannot help)."""
    url = str(tmp_path / "c")
    params = {f"layer{i}": {"w": np.ones(2), "b": np.zeros(1), "s": np.ones(1)} for i in range(100)}
    zarrckpt.save_pytree(url, {"params": params, "step": 3})
    with pytest.raises(zarrckpt.CheckpointMismatchError) as info:
        zarrckpt.load_pytree(url, {"model": params, "step": 0})
    message = str(info.value)
    assert message.splitlines()[1:] == [
        "  ['model'] (300 leaves): in the target but not in the checkpoint",
        "  ['params'] (300 leaves): in the checkpoint but not in the target",
        "(the target's ['model'] and the checkpoint's ['params'] hold the same 300 key paths below them: a renamed "
        "subtree? put it at ['params'] in the target to restore it)"], message
    assert "600 problem(s)" in message and "partial=True" not in message
    # The target lacks a subtree the checkpoint has: partial=True helps, and is said.
    with pytest.raises(zarrckpt.CheckpointMismatchError) as info:
        zarrckpt.load_pytree(url, {"params": {k: v for k, v in params.items() if k != "layer7"}, "step": 0,
                                   "new": {f"h{i}": np.ones(1) for i in range(30)}}, partial=True)
    assert str(info.value).splitlines()[1:] == [
        "  ['new'] (30 leaves): in the target but not in the checkpoint",
        "(the target's leaves the checkpoint lacks cannot be restored, with partial=True or without: leave them "
        "out of the target and make them after the restore, or pass fallback=True to keep the target's own values "
        "for them)"]
    with pytest.raises(zarrckpt.CheckpointMismatchError) as info:
        zarrckpt.load_pytree(url, {"params": {k: {**v, "w": np.ones(2, np.float32)} for k, v in params.items()},
                                   "step": 0})
    lines = str(info.value).splitlines()
    assert "100 problem(s)" in lines[0] and len(lines) == 1 + 20 + 1 and lines[-1] == "  ... and 80 more"
    assert lines[1] == ("  ['params']['layer0']['w']: dtype float64 in the checkpoint, float32 in the target "
                        "(pass allow_dtype_cast=True to convert)")


def test_bad_target_leaf(tmp_path):
    url = str(tmp_path / "c")
    zarrckpt.save_pytree(url, {"a": np.ones(2)})
    with pytest.raises(zarrckpt.UnsupportedLeafError, match=r"target leaf \['a'\] is a object"):
        zarrckpt.load_pytree(url, {"a": object()})  # a str target leaf is a mismatch since issue 10


def test_bad_url_and_step(tmp_path):
    with pytest.raises(ValueError, match="non-empty string"):
        zarrckpt.save_pytree("", {"a": 1})
    with pytest.raises(ValueError, match="step must be a non-negative int, got -1"):
        zarrckpt.save_checkpoint(str(tmp_path), -1, {"a": 1})


def test_newer_format_is_refused(tmp_path):
    url = tmp_path / "c"
    zarrckpt.save_pytree(str(url), {"a": np.ones(2)})
    edit_group_attributes(url, lambda attrs: attrs["zarrckpt"].update(format_version=99))
    with pytest.raises(zarrckpt.CheckpointCorruptError,
                       match=f"format_version 99; this zarrckpt reads up to {zarrckpt.FORMAT_VERSION}"):
        zarrckpt.load_pytree(str(url))


def test_errors_say_what_went_wrong_in_the_users_words(tmp_path, s3_server):
    (tmp_path / "a_file").write_text("not a directory")
    with pytest.raises(zarrckpt.CheckpointWriteError, match=f"{tmp_path}/a_file is a file, not a directory"):
        zarrckpt.save_pytree(str(tmp_path / "a_file" / "ckpt"), {"w": np.ones(2)})
    url = f"s3://zarrckpt-no-such-bucket-{tmp_path.name.lower()[-20:]}/run"
    bucket = url.split("/")[2]
    with pytest.raises(zarrckpt.CheckpointLocationError, match=f"{url}: the bucket '{bucket}' does not exist"):
        zarrckpt.CheckpointManager(url, storage_options=s3_server.options())


def test_saving_an_unfiltered_equinox_model_says_how_to_filter(tmp_path):
    import equinox as eqx
    import jax

    model = eqx.nn.MLP(2, 2, 4, 1, key=jax.random.key(0))
    with pytest.raises(zarrckpt.UnsupportedLeafError, match=r"\.activation is a .*eqx\.filter\(model, "
                                                            r"eqx\.is_array\)"):
        zarrckpt.save_pytree(str(tmp_path), model)
    zarrckpt.save_pytree(str(tmp_path), eqx.filter(model, eqx.is_array))


def test_a_saved_python_int_restores_into_a_float_target_when_asked(tmp_path):
    url = str(tmp_path / "c")
    zarrckpt.save_pytree(url, {"lr": 3, "z": 1j})
    with pytest.raises(zarrckpt.CheckpointMismatchError,
                       match=r"\['lr'\]: a Python int in the checkpoint, a Python float in the target \(pass "
                             r"allow_dtype_cast=True to convert it\)"):
        zarrckpt.load_pytree(url, {"lr": 0.0, "z": 0j})
    back = zarrckpt.load_pytree(url, {"lr": 0.0, "z": 0j}, allow_dtype_cast=True)
    assert back == {"lr": 3.0, "z": 1j} and type(back["lr"]) is float
    with pytest.raises(zarrckpt.CheckpointMismatchError, match=r"a Python complex in the checkpoint, a Python float"):
        zarrckpt.load_pytree(url, {"lr": 0.0, "z": 0.0}, allow_dtype_cast=True)


@pytest.mark.parametrize(("url", "extra"), [("s3://bucket/run", "s3"), ("gs://bucket/run", "gcs")])
def test_an_object_store_url_without_its_client_names_the_extra_to_install(url, extra):
    """zarrckpt installed without the extra an object store needs: the error names the
    URL and `pip install 'zarrckpt[...]'`, which brings the release zarrckpt needs (a
    bare `pip install s3fs` may bring an older one), not fsspec's "Install s3fs" inside
    a long traceback. Run where the clients cannot be imported."""
    import subprocess
    import sys

    script = ("import sys; sys.modules['s3fs'] = sys.modules['gcsfs'] = None\n"
              "import zarrckpt\n"
              f"try:\n    zarrckpt.latest_step({url!r})\n"
              "except ImportError as e:\n    print(e)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "JAX_PLATFORMS": "cpu",
                               "PYTHONPATH": str(Path(__file__).parent.parent)})
    assert done.returncode == 0, done.stderr
    assert url in done.stdout and f"pip install 'zarrckpt[{extra}]'" in done.stdout, done.stdout


def test_a_damaged_chunk_reaches_the_caller_as_a_public_error(tmp_path):
    """What a load or a copy of a checkpoint with a damaged chunk raises is named, in the
    traceback's last line too, as a class the user can import and find in the docs."""
    url = tmp_path / "c"
    zarrckpt.save_pytree(str(url), {"w": np.arange(16, dtype=np.float32)})
    chunk = next(p for p in (url / "w").rglob("c*") if p.is_file())
    data = bytearray(chunk.read_bytes())
    data[0] ^= 1
    chunk.write_bytes(bytes(data))
    key = chunk.relative_to(url).as_posix()
    for call in (lambda: zarrckpt.load_pytree(str(url)),
                 lambda: zarrckpt.copy_checkpoint(str(url), str(tmp_path / "copy"))):
        with pytest.raises(zarrckpt.CheckpointCorruptError) as info:
            call()
        kind = type(info.value)
        name = f"{kind.__module__}.{kind.__qualname__}"
        assert name == "zarrckpt.errors.CheckpointCorruptError", name
        assert f"chunk {key!r}" in str(info.value) and "fails its CRC-32C" in str(info.value)
        last = traceback.format_exception_only(info.value)[0]  # the line naming it; the notes follow
        assert last.startswith(f"{name}: chunk {key!r}"), last
        assert "DamagedChunk" not in "".join(traceback.format_exception(info.value))
