"""Hostile keys and hostile checkpoints: nothing escapes the directory, nothing runs, nothing
is allocated before the checkpoint is shown to be sane."""

import json
import re
from pathlib import Path

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import zarrckpt

PACKAGE = Path(zarrckpt.__file__).parent

hostile_text = st.one_of(
    st.sampled_from(["..", ".", "/", "../..", "/etc/passwd", "a/../../b", "\x00", "zarr.json", "c", "%",
                     "%2F", "~", "", " ", "\\", "C:\\x", "__init__", "é/ü", "k" * 300]),
    st.text(max_size=40),
)
trees = st.recursive(
    st.builds(lambda n: np.arange(n, dtype=np.int16), st.integers(0, 4)),
    lambda children: st.dictionaries(hostile_text, children, max_size=4) | st.lists(children, max_size=3),
    max_leaves=12,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tree=st.dictionaries(hostile_text, trees, min_size=1, max_size=4))
def test_any_keys_stay_inside_and_round_trip(tmp_path_factory, tree):
    root = tmp_path_factory.mktemp("keys")
    url = root / "ckpt"
    zarrckpt.save_pytree(str(url), tree)
    for path in root.rglob("*"):
        assert url in path.parents or path == url, path
        assert len(path.name.encode()) <= 255
    back = zarrckpt.load_pytree(str(url))
    assert flat(back) == flat(tree)


def flat(tree):
    return sorted((jax.tree_util.keystr(p), v.tobytes()) for p, v in jax.tree_util.tree_flatten_with_path(tree)[0])


def test_no_code_runs_from_a_checkpoint():
    # Metadata is JSON, read with json.loads; nothing in the package, at any depth
    # (_format/ and _restore/ parse what a checkpoint holds), can unpickle or eval.
    modules = sorted(PACKAGE.rglob("*.py"))
    assert {p.parent.name for p in modules} >= {"zarrckpt", "_format", "_restore", "_save", "_storage"}
    for module in modules:
        source = module.read_text()
        for forbidden in (r"\bpickle\b", r"\beval\(", r"\bexec\(", r"\bmarshal\b", r"\bshelve\b",
                          r"allow_pickle\s*=\s*True"):
            assert not re.search(forbidden, source), f"{forbidden} in {module.relative_to(PACKAGE)}"


def edit_record(url: Path, edit) -> None:
    doc = json.loads((url / "zarr.json").read_text())
    edit(doc)
    (url / "zarr.json").write_text(json.dumps(doc))


def saved(tmp_path) -> Path:
    url = tmp_path / "c"
    zarrckpt.save_pytree(str(url), {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "s": 1})
    return url


def leaf_spec(doc, name):
    return next(c for c in doc["attributes"]["zarrckpt"]["tree"]["children"] if c.get("name") == name)


def set_shape(doc, shape, chunks=None):
    leaf_spec(doc, "w")["shape"] = shape
    array = doc["consolidated_metadata"]["metadata"]["w"]
    array["shape"] = shape
    if chunks is not None:
        array["chunk_grid"]["configuration"]["chunk_shape"] = chunks


@pytest.mark.parametrize("edit, message", [
    (lambda d: set_shape(d, [10**7, 10**6], [10**5, 10**5]), "needs 40,000,000,000,000 bytes"),
    (lambda d: set_shape(d, [10**7, 10**6], [1, 1]), "a grid of 10,000,000,000,000 chunks"),
    (lambda d: set_shape(d, [2**40, 2**40], [1, 1]), "malformed metadata"),
    (lambda d: set_shape(d, [-3, 4]), "malformed metadata"),
    (lambda d: set_shape(d, [3, 4], [0, 4]), "malformed metadata"),
    (lambda d: set_shape(d, [3, 4], [3]), "malformed metadata"),
    (lambda d: leaf_spec(d, "w").update(dtype="object"), "malformed metadata"),
    (lambda d: leaf_spec(d, "w").update(shape=[4, 3]), "array shape"),
    (lambda d: d["attributes"]["zarrckpt"].update(tree=["not", "a", "tree"]), "malformed metadata"),
    (lambda d: d["consolidated_metadata"]["metadata"].pop("w"), "malformed metadata"),
])
def test_hostile_metadata_fails_before_allocating(tmp_path, edit, message):
    url = saved(tmp_path)
    edit_record(url, edit)
    with pytest.raises(zarrckpt.CheckpointCorruptError, match=re.escape(message)):
        zarrckpt.load_pytree(str(url))


@pytest.mark.parametrize("url", ["gs:/bucket/run", "s3:/bucket/run", "memory:/run"])
def test_a_url_with_one_slash_after_its_scheme_is_refused_naming_the_url_meant(tmp_path, monkeypatch, url):
    """fsspec would read `gs:/bucket/run` as the local path ./gs:/bucket/run, and the
    checkpoints would go to the working directory."""
    monkeypatch.chdir(tmp_path)
    meant = url.replace(":/", "://", 1)
    for call in (lambda: zarrckpt.CheckpointManager(url), lambda: zarrckpt.save_pytree(url, {"w": np.ones(2)}),
                 lambda: zarrckpt.all_steps(url)):
        with pytest.raises(ValueError, match=re.escape(repr(meant))):
            call()
    assert not list(tmp_path.iterdir())


def test_a_best_metric_no_save_carries_is_warned_about_naming_the_close_one(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="zarrckpt"), \
            zarrckpt.CheckpointManager(str(tmp_path), keep_best=1, best_metric="val_loss") as mgr:
        for step in (1, 2):
            mgr.save(step, {"w": np.ones(2)}, metrics={"val_los": 1.0 / step})
    said = [r.getMessage() for r in caplog.records if "best_metric 'val_loss'" in r.getMessage()]
    assert len(said) == 1 and "'val_los'" in said[0], caplog.text
