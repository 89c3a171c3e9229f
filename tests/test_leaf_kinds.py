"""Leaves beyond arrays: str and bytes, and PerProcess values each process saves for itself."""

import enum
import json
import re

import jax.numpy as jnp
import numpy as np
import pytest

import zarrckpt


class Mode(enum.IntEnum):
    TRAIN = 1
    EVAL = 2


def test_str_and_bytes_leaves_round_trip(tmp_path):
    url = str(tmp_path / "c")
    tree = {"config": "model: tiny\nlr: 3e-4 ✓", "tokenizer": "", "blob": b"\x00\xffraw", "w": np.arange(3.0)}
    zarrckpt.save_pytree(url, tree)
    back = zarrckpt.load_pytree(url)
    assert back["config"] == tree["config"] and back["tokenizer"] == "" and back["blob"] == tree["blob"]
    target = {"config": "", "tokenizer": "", "blob": b"", "w": np.zeros(3)}
    back = zarrckpt.load_pytree(url, target)
    assert back["config"] == tree["config"] and back["blob"] == tree["blob"]
    described = zarrckpt.metadata(url)
    kinds = {leaf.key_path: leaf.kind for leaf in described.leaves}
    assert kinds["['config']"] == "str" and kinds["['blob']"] == "bytes"
    assert described.tree["config"] == "" and described.tree["blob"] == b""  # usable as a restore target
    with pytest.raises(zarrckpt.CheckpointMismatchError, match=r"\['blob'\]: a str in the target, saved as bytes"):
        zarrckpt.load_pytree(url, {**target, "blob": ""})
    assert zarrckpt.verify(url).ok
    assert zarrckpt.metadata(url).format_version == 3  # older zarrckpt refuses it rather than misread it


def test_numpy_strings_and_python_number_subclasses_save_as_what_they_are(tmp_path):
    """numpy's str_ and bytes_ are a str and bytes, an IntEnum member an int: each saves
    and restores as one, with or without a target."""
    url = str(tmp_path / "c")
    tree = {"name": np.str_("ééé"), "blob": np.bytes_(b"\x00ab"), "mode": Mode.EVAL}
    zarrckpt.save_pytree(url, tree)
    back = zarrckpt.load_pytree(url)
    assert back == {"name": "ééé", "blob": b"\x00ab", "mode": 2} and type(back["mode"]) is int
    assert zarrckpt.load_pytree(url, {"name": "", "blob": b"", "mode": 0}) == back


def test_per_process_leaf_on_one_process(tmp_path):
    url = str(tmp_path)
    loader = {"epoch": 2, "next_index": 17, "seed": None}
    zarrckpt.save_checkpoint(url, 1, {"w": jnp.ones(2), "data": zarrckpt.PerProcess(loader),
                                      "raw": zarrckpt.PerProcess(b"\x01\x02"), "name": zarrckpt.PerProcess("h0")})
    back, _ = zarrckpt.load_checkpoint_if_it_exists(
        url, {"w": jnp.zeros(2), "data": zarrckpt.PerProcess(None), "raw": zarrckpt.PerProcess(None),
              "name": zarrckpt.PerProcess(None)})
    assert back["data"] == zarrckpt.PerProcess(loader)
    assert back["raw"].value == b"\x01\x02" and back["name"].value == "h0"
    assert zarrckpt.load_pytree(f"{url}/0000000001")["data"].value == loader
    assert zarrckpt.verify(f"{url}/0000000001").ok
    with pytest.raises(zarrckpt.UnsupportedLeafError, match=r"PerProcess leaf \['data'\]: its value must be JSON"):
        zarrckpt.save_checkpoint(url, 2, {"data": zarrckpt.PerProcess({"f": object()})})


def test_per_process_leaf_saved_by_another_process_count(tmp_path):
    url = tmp_path / "c"
    zarrckpt.save_pytree(str(url), {"data": zarrckpt.PerProcess([1, 2])})
    doc = json.loads((url / "zarr.json").read_text())  # as if saved by 4 processes
    doc["attributes"]["zarrckpt"]["tree"]["children"][0]["processes"] = 4
    (url / "zarr.json").write_text(json.dumps(doc))
    with pytest.raises(zarrckpt.CheckpointMismatchError,
                       match=re.escape("['data']: saved by 4 process(es), restored by 1")):
        zarrckpt.load_pytree(str(url), {"data": zarrckpt.PerProcess(None)})
    relaxed = zarrckpt.PerProcess({"start": 0}, strict=False)
    assert zarrckpt.load_pytree(str(url), {"data": relaxed})["data"] is relaxed
