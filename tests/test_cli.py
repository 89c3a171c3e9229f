"""The `zarrckpt` command, run as a user runs it: a real process, its output and exit status.

Commands run as `python -m zarrckpt` on this working tree, each in a process forked
from one that has imported zarrckpt already (tests/forked_cli.py: the import costs ten
times the command); one test runs the installed `zarrckpt` script where the package is
installed (CI's `pip install ".[test]"`).
"""

import json
import os
import shutil
import sysconfig
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy
from forked_cli import run, run_together
from object_store_servers import TEST_KEY, TEST_SECRET

import zarrckpt
from zarrckpt import _cli, _commit, _storage
from zarrckpt._cli import commands as _commands
from zarrckpt._run import retention as _retention


def state(scale: float = 1.0) -> dict:
    return {"params": {"w": (jnp.arange(32, dtype=jnp.float32).reshape(8, 4) * scale).astype(jnp.bfloat16),
                       "b": np.full(4, scale, np.float32)},
            "step": 7, "rng": jax.random.key(1)}


@pytest.fixture
def run_dir(tmp_path) -> str:
    """Steps 10, 20, 30 committed, 10 pinned, and an uncommitted leftover at 40."""
    root = str(tmp_path / "run")
    for step in (10, 20, 30):
        zarrckpt.save_checkpoint(root, step, state(step))
    _storage.resolve(root).step(10).write(_retention.PIN_FILE, b"")
    zarrckpt.save_checkpoint(root, 40, state(40))
    uncommit(_storage.resolve(root).step(40))
    return root


def uncommit(loc: _storage.Location) -> None:
    """Takes the commit marker away, as a crash before the commit leaves a checkpoint."""
    doc = json.loads(loc.read("zarr.json"))
    del doc["attributes"]["write_completed"]
    loc.write("zarr.json", json.dumps(doc).encode())


def test_ls_info_verify(run_dir):
    listed, info, table, ok = run_together([["ls", run_dir], ["info", f"{run_dir}/0000000030", "--json"],
                                            ["info", f"{run_dir}/0000000030"], ["verify", f"{run_dir}/0000000030"]])
    assert listed.returncode == 0, listed.stderr
    rows = [line.split() for line in listed.stdout.splitlines()]
    assert rows[0] == ["step", "state", "pinned", "size", "leaves", "written"]
    assert [r[0] for r in rows[1:]] == ["10", "20", "30", "40"]  # newest last
    assert rows[1][1:3] == ["committed", "pinned"] and rows[4][1] == "uncommitted"
    assert rows[2][2:5] == ["96", "B", "4"]  # 64 + 16 + 8 + 8 bytes of data, 4 leaves

    assert info.returncode == 0, info.stderr
    described = json.loads(info.stdout)
    assert described["committed"] and described["nbytes"] == 96
    leaves = {leaf["name"]: leaf for leaf in described["leaves"]}
    assert leaves["params.w"] == {"name": "params.w", "key_path": "['params']['w']", "shape": [8, 4],
                                  "dtype": "bfloat16", "chunks": [8, 4], "kind": "jax", "prng_impl": None,
                                  "nbytes": 64}
    assert leaves["rng"]["kind"] == "prng_key" and leaves["rng"]["prng_impl"] == "threefry2x32"
    assert leaves["step"]["shape"] == []

    assert table.returncode == 0, table.stderr
    assert "committed, zarrckpt format 2" in table.stdout  # arrays only: format 2, as before str leaves
    assert any(line.split() == ["params.w", "(8,", "4)", "bfloat16", "(8,", "4)", "64", "B"]
               for line in table.stdout.splitlines())
    assert table.stdout.splitlines()[0].endswith(", 4 leaves, 96 B")  # the totals first

    assert ok.returncode == 0 and ok.stdout.startswith("OK: "), ok.stdout + ok.stderr


def delete_chunk(loc: _storage.Location) -> str:
    os.remove(f"{loc.path}/params.w/c.0.0")
    return "params.w/c.0.0: missing (leaf ['params']['w'])"


def truncate_chunk(loc: _storage.Location) -> str:
    with open(f"{loc.path}/params.b/c.0", "r+b") as f:
        f.truncate(10)
    return "params.b/c.0: has 10 bytes, expected"


def flip_bit(loc: _storage.Location) -> str:
    with open(f"{loc.path}/params.w/c.0.0", "r+b") as f:
        first = f.read(1)[0]
        f.seek(0)
        f.write(bytes([first ^ 1]))
    return "params.w/c.0.0: fails its CRC-32C checksum"


def remove_marker(loc: _storage.Location) -> str:
    uncommit(loc)
    return "zarr.json: not committed"


def test_verify_fails_on_damage(run_dir):
    zarrckpt.save_checkpoint(run_dir, 50, state(50))
    damages = {10: delete_chunk, 20: truncate_chunk, 30: remove_marker, 50: flip_bit}
    urls = {step: _storage.resolve(run_dir).step(step).url for step in damages}
    expected = {step: damage(_storage.resolve(urls[step])) for step, damage in damages.items()}
    for step, done in zip(damages, run_together([["verify", urls[step]] for step in damages])):
        assert done.returncode == _cli.EXIT_DAMAGED, (damages[step].__name__, done.stdout + done.stderr)
        assert expected[step] in done.stdout and "DAMAGED" in done.stdout, done.stdout


def test_verify_report(tmp_path):
    url = str(tmp_path / "c")
    zarrckpt.save_pytree(url, {"a": np.ones((6, 4), np.float32), "b": np.zeros(3), "s": 1.5}, max_chunk_bytes=32)
    report = zarrckpt.verify(url)
    assert report.ok and report.committed and report.leaves == 3 and report.chunks_checked == 3 + 1 + 1
    assert report.checksums_checked == 5 and zarrckpt.verify(url, checksums=False).checksums_checked == 0
    loc = _storage.resolve(url)
    shutil.rmtree(f"{loc.path}/b")
    doc = json.loads(loc.read("a/zarr.json"))
    doc["shape"] = [6, 5]
    loc.write("a/zarr.json", json.dumps(doc).encode())
    os.remove(f"{loc.path}/a/c.2.0")
    problems = {p.key: p for p in zarrckpt.verify(url).problems}
    assert set(problems) == {"a/zarr.json", "a/c.2.0", "b/zarr.json", "b/"}, problems
    assert "shape [6, 5]" in problems["a/zarr.json"].message and problems["a/c.2.0"].leaf == "['a']"
    assert "directory is missing (all 1 chunks)" in problems["b/"].message


def test_verify_quick_reads_no_chunk_yet_finds_missing_and_short_chunks(tmp_path, monkeypatch):
    url = str(tmp_path / "c")
    zarrckpt.save_pytree(url, {"a": np.ones((6, 4), np.float32), "b": np.arange(16.0)}, max_chunk_bytes=32)
    path = _storage.resolve(url).path
    os.remove(f"{path}/a/c.1.0")
    os.truncate(f"{path}/b/c.2", 10)
    with open(f"{path}/b/c.0", "r+b") as f:  # a flipped bit: only reading the chunk finds it
        f.write(bytes([f.read(1)[0] ^ 1]))
    read: list[str] = []

    def metadata_only(method):
        def refusing(self, key, *args, **kwargs):
            read.append(key)
            if key.rpartition("/")[2] != "zarr.json":
                raise PermissionError(f"this store refuses chunk reads, asked for {key}")
            return method(self, key, *args, **kwargs)
        return refusing

    for name in ("read", "read_into", "read_range"):
        monkeypatch.setattr(_storage.LocalDisk, name, metadata_only(getattr(_storage.LocalDisk, name)))
    report = zarrckpt.verify(url, checksums=False)
    problems = {p.key: p.message for p in report.problems}
    assert sorted(problems) == ["a/c.1.0", "b/c.2"], problems
    assert problems["a/c.1.0"] == "missing" and problems["b/c.2"].startswith("has 10 bytes, expected")
    assert report.chunks_checked == 3 + 4 and report.checksums_checked == 0
    # Metadata, and no chunk; the commit marker once more, as problems were found (the
    # step was not deleted or replaced meanwhile: then they would not be damage).
    assert sorted(read) == ["a/zarr.json", "b/zarr.json", "zarr.json", "zarr.json"]
    with pytest.raises(PermissionError, match="refuses chunk reads"):  # the store does refuse: a full verify reads
        zarrckpt.verify(url)


def test_verify_judges_an_array_zarr_json_by_what_it_says_not_how_it_is_spelled(tmp_path):
    url = str(tmp_path / "c")
    zarrckpt.save_pytree(url, {"a": np.ones((6, 4), np.float32)}, max_chunk_bytes=32)
    loc = _storage.resolve(url)
    doc = json.loads(loc.read("a/zarr.json"))
    loc.write("a/zarr.json", json.dumps(doc, indent=2, sort_keys=True).encode())  # as another zarr writer may
    assert zarrckpt.verify(url).ok
    doc["chunk_grid"]["configuration"]["chunk_shape"] = [2.0, 4]  # equal to [2, 4] in Python, not in JSON
    loc.write("a/zarr.json", json.dumps(doc).encode())
    assert [(p.key, "does not match the tree record" in p.message) for p in zarrckpt.verify(url).problems] == [
        ("a/zarr.json", True)]


def test_verify_on_object_store(s3_server):
    url = f"s3://{s3_server.new_bucket()}/c"
    options = s3_server.options()
    zarrckpt.save_pytree(url, {"a": np.ones((64, 4), np.float32)}, storage_options=options, max_chunk_bytes=64)
    s3_server.recorder.reset()
    assert zarrckpt.verify(url, storage_options=options, checksums=False).chunks_checked == 16
    kinds = [s3_server.kind(method, target) for method, target in s3_server.recorder.answered]
    # The group's and the array's zarr.json, and one listing for the array's 16 chunks
    # (a request sent again after its client gave up on it, on a busy machine, counts once).
    assert sorted(kinds) == ["list", "read", "read"], s3_server.recorder.requests
    s3_server.recorder.reset()
    assert zarrckpt.verify(url, storage_options=options).checksums_checked == 16
    assert [s3_server.kind(*r) for r in s3_server.recorder.answered].count("read") == 2 + 16


def test_gc_dry_run_then_for_real(tmp_path):
    root = str(tmp_path / "run")
    for step in range(1, 7):
        zarrckpt.save_checkpoint(root, step, {"x": step})
    _storage.resolve(root).step(2).write(_retention.PIN_FILE, b"")
    dry = run("gc", root, "--keep-last", "2", "--keep-every", "3", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.splitlines() == ["would delete step 1", "would delete step 4",
                                       "committed steps kept: 2, 3, 5, 6"]
    assert zarrckpt.all_steps(root) == [1, 2, 3, 4, 5, 6]
    real = run("gc", root, "--keep-last", "2", "--keep-every", "3", "--json")
    assert real.returncode == 0, real.stderr
    assert json.loads(real.stdout) == {"dry_run": False, "deleted": [1, 4], "kept": [2, 3, 5, 6]}
    assert zarrckpt.all_steps(root) == [2, 3, 5, 6]


def test_gc_of_a_mistyped_directory_or_of_a_step_fails_naming_it(tmp_path):
    root = str(tmp_path / "run")
    zarrckpt.save_checkpoint(root, 1, {"x": 1})
    missing, step = run_together([["gc", f"{root}-typo", "--keep-last", "1"],
                                  ["gc", f"{root}/0000000001", "--keep-last", "1"]])
    assert missing.returncode == 1 and f"{root}-typo" in missing.stderr, missing
    assert step.returncode == 1 and f"{root}/0000000001" in step.stderr, step
    assert zarrckpt.all_steps(root) == [1]


def test_gc_leaves_uncommitted_steps_to_a_live_manager_and_deletes_them_once_it_is_gone(tmp_path):
    """An uncommitted step older than the newest committed reads as a crash's leftover,
    but a live manager may be saving it (`force=True`): gc leaves it while the run's
    lease is held, saying why, and deletes it once the lease is released."""
    root = tmp_path / "run"
    with zarrckpt.CheckpointManager(str(root)) as mgr:
        for step in (1, 2, 10):
            assert mgr.save(step, {"x": step}, force=True)
        mgr.wait()  # the saves are asynchronous: step 2's commit would rewrite the marker removed below
        (root / "0000000002" / "zarr.json").unlink()  # as a save in progress reads: uncommitted
        held = run("gc", str(root), "--keep-last", "5")
        assert held.returncode == 0 and "uncommitted steps" in held.stderr and "left alone" in held.stderr, held
        assert (root / "0000000002").is_dir()
    gone = run("gc", str(root), "--keep-last", "5", "--json")
    assert gone.returncode == 0, gone.stderr
    assert json.loads(gone.stdout) == {"dry_run": False, "deleted": [2], "kept": [1, 10]}
    assert not (root / "0000000002").exists() and zarrckpt.all_steps(str(root)) == [1, 10]


def test_gc_keeps_every_kth_alone_and_the_best_as_the_manager_does(tmp_path):
    root = str(tmp_path / "run")
    with zarrckpt.CheckpointManager(root, async_save=False) as mgr:
        for step in range(1, 8):
            mgr.save(step, {"x": step}, metrics={"val_loss": abs(step - 3)})  # step 3 is the best
    every = run("gc", root, "--keep-every", "2", "--json")
    assert every.returncode == 0, every.stderr
    assert json.loads(every.stdout)["kept"] == [2, 4, 6, 7]  # every 2nd, and the newest
    best = run("gc", root, "--keep-last", "1", "--keep-best", "1", "--best-metric", "val_loss", "--json")
    assert best.returncode == 0, best.stderr
    assert json.loads(best.stdout)["kept"] == [4, 7]  # 2 and 4 tie for the best left: the newer ranks first
    nothing, unnamed = run_together([["gc", root], ["gc", root, "--keep-best", "1"]])
    assert nothing.returncode == 1 and "--keep-last N, --keep-every K or --keep-best N" in nothing.stderr
    assert unnamed.returncode == 1 and "--keep-best N and --best-metric NAME go together" in unnamed.stderr
    assert zarrckpt.all_steps(root) == [4, 7]


def test_cp_local_to_local(run_dir, tmp_path):
    src, dst = f"{run_dir}/0000000030", str(tmp_path / "copy")
    first = run("cp", src, dst)
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("copied ") and zarrckpt.verify(dst).ok
    back = zarrckpt.load_pytree(dst)
    np.testing.assert_array_equal(back["params"]["w"], np.asarray(state(30)["params"]["w"]))
    again, uncommitted = run_together([["cp", src, dst], ["cp", f"{run_dir}/0000000040", str(tmp_path / "x")]])
    assert again.returncode == 1 and "already holds a committed checkpoint" in again.stderr
    assert uncommitted.returncode == 1 and "is not committed" in uncommitted.stderr
    replaced = run("cp", f"{run_dir}/0000000020", dst, "--overwrite", "--no-progress")
    assert replaced.returncode == 0, replaced.stderr
    assert zarrckpt.load_pytree(dst)["step"] == 7 and zarrckpt.verify(dst).ok
    np.testing.assert_array_equal(zarrckpt.load_pytree(dst)["params"]["b"], np.full(4, 20.0, np.float32))


def test_cp_to_s3_with_environment_credentials(run_dir, s3_server):
    dst = f"s3://{s3_server.new_bucket()}/run/0000000030"
    env = {"AWS_ACCESS_KEY_ID": TEST_KEY, "AWS_SECRET_ACCESS_KEY": TEST_SECRET,
           "FSSPEC_S3_ENDPOINT_URL": s3_server.endpoint}
    copied = run("cp", f"{run_dir}/0000000030", dst, env=env)
    assert copied.returncode == 0, copied.stderr
    options = ["-o", f"endpoint_url={s3_server.endpoint}", "-o", f"key={TEST_KEY}", "-o", f"secret={TEST_SECRET}"]
    checked, listed = run_together([["verify", dst, *options], ["ls", dst.rsplit("/", 1)[0], *options]])
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert listed.stdout.splitlines()[1].split()[:2] == ["30", "committed"]
    assert TEST_SECRET not in copied.stdout + copied.stderr + checked.stdout + listed.stdout


def test_a_password_in_a_url_is_never_printed():
    # Port 9 (discard) on loopback: nothing listens, every request fails at once.
    url = "http://alice:Pa55-word@127.0.0.1:9/run"
    results = run_together([["ls", url], ["info", f"{url}/0000000010"], ["verify", f"{url}/0000000010"],
                            ["info", f"{url}/0000000010", "--debug"]])
    for result in results:
        assert result.returncode == 1
        out = result.stdout + result.stderr
        assert "Pa55-word" not in out and "alice:***@127.0.0.1:9/run" in out, out


def test_debug_shows_zarrckpt_log_without_other_libraries_request_headers(run_dir, s3_server):
    run_url = f"s3://{s3_server.new_bucket()}/run"
    token = "SESSION-TOKEN-" + "x" * 40
    env = {"AWS_ACCESS_KEY_ID": TEST_KEY, "AWS_SECRET_ACCESS_KEY": TEST_SECRET, "AWS_SESSION_TOKEN": token,
           "FSSPEC_S3_ENDPOINT_URL": s3_server.endpoint}
    # Step 20 is there for gc to delete: copied here, as what it prints is not looked at.
    zarrckpt.copy_checkpoint(f"{run_dir}/0000000020", f"{run_url}/0000000020", dst_storage_options=s3_server.options())
    copy = run("cp", f"{run_dir}/0000000030", f"{run_url}/0000000030", "--debug", env=env)
    commands = [["ls", run_url], ["info", f"{run_url}/0000000030"], ["verify", f"{run_url}/0000000030"]]
    results = [copy, *run_together([[*c, "--debug"] for c in commands], env=env),
               run("gc", run_url, "--keep-last", "1", "--debug", env=env)]
    assert [r.returncode for r in results] == [0] * 5, [r.stderr for r in results]
    out = "".join(r.stdout + r.stderr for r in results)
    assert "zarrckpt: deleted step 20" in results[-1].stderr  # zarrckpt's own log is there...
    loggers = {line.split(":", 1)[0].split(".")[0] for line in out.splitlines() if ": " in line}
    others = {"botocore", "aiobotocore", "s3fs", "fsspec", "urllib3", "asyncio"}
    assert not loggers & others, loggers  # ...no one else's
    for secret in (TEST_KEY, TEST_SECRET, token):
        assert secret not in out


def test_cp_into_an_existing_directory_puts_the_copy_inside_it(run_dir, tmp_path):
    (tmp_path / "nested").mkdir()
    other = str(tmp_path / "run2")
    zarrckpt.save_checkpoint(other, 5, state(5))  # a directory of steps
    inside, step = run_together([["cp", f"{run_dir}/0000000030", f"{tmp_path}/nested/"],
                                 ["cp", f"{run_dir}/0000000030", other]])
    assert inside.returncode == 0 and step.returncode == 0, inside.stderr + step.stderr
    assert f"to {tmp_path}/nested/0000000030 " in inside.stdout
    assert zarrckpt.verify(f"{tmp_path}/nested/0000000030").ok and sorted(os.listdir(tmp_path / "nested")) == [
        "0000000030"]
    assert zarrckpt.all_steps(other) == [5, 30]  # another run gets the step beside its own


def test_copy_commits_last_and_not_at_all_on_failure(run_dir, tmp_path, monkeypatch):
    src, dst = f"{run_dir}/0000000030", str(tmp_path / "copy")
    written, failing = [], True
    original = _storage.Location.write

    def recording(self, key, data, **kwargs):
        written.append((key, data))
        if failing and key == "params.b/c.0":
            raise OSError("injected failure")
        return original(self, key, data, **kwargs)

    monkeypatch.setattr(_storage.Location, "write", recording)
    with pytest.raises(zarrckpt.CheckpointWriteError, match="injected failure"):
        zarrckpt.copy_checkpoint(src, dst)
    # Group metadata first, without the marker: the partial copy is an uncommitted checkpoint.
    assert written[0][0] == "zarr.json" and b"write_completed" not in bytes(written[0][1])
    assert _commit.head(_storage.resolve(dst)).state is _commit.State.UNCOMMITTED
    failing = False
    written.clear()
    result = zarrckpt.copy_checkpoint(src, dst)  # replaces the partial copy
    assert written[-1][0] == "zarr.json" and b'"write_completed":true' in bytes(written[-1][1])
    assert result.objects == len(written) - 1 and zarrckpt.verify(dst).ok
    with pytest.raises(ValueError, match="lies inside it"):
        zarrckpt.copy_checkpoint(src, f"{src}/nested")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "keep.txt").write_text("mine")
    with pytest.raises(zarrckpt.CheckpointExistsError, match="not a checkpoint"):
        zarrckpt.copy_checkpoint(src, str(tmp_path / "notes"), overwrite=True)
    assert (tmp_path / "notes" / "keep.txt").exists()


def test_export_npz_and_safetensors(run_dir, tmp_path):
    url = f"{run_dir}/0000000030"
    npz, st = run_together([["export", url, str(tmp_path / "state.npz")],
                            ["export", url, str(tmp_path / "state.safetensors")]])
    assert npz.returncode == 0, npz.stderr
    assert "params.w: bfloat16 widened to float32" in npz.stdout
    expected = state(30)
    with np.load(tmp_path / "state.npz") as arrays:
        assert sorted(arrays.files) == ["params.b", "params.w", "rng", "step"]  # the names `info` lists
        np.testing.assert_array_equal(arrays["params.w"], np.asarray(expected["params"]["w"], np.float32))
        np.testing.assert_array_equal(arrays["rng"], jax.random.key_data(expected["rng"]))
        assert arrays["step"].shape == () and arrays["step"] == 7

    assert st.returncode == 0 and "widened" not in st.stdout, st.stdout + st.stderr
    tensors = {name: t for name, t in safetensors.deserialize((tmp_path / "state.safetensors").read_bytes())}
    assert tensors["params.w"]["dtype"] == "BF16" and tensors["params.w"]["shape"] == [8, 4]
    w = np.frombuffer(bytes(tensors["params.w"]["data"]), ml_dtypes.bfloat16).reshape(8, 4)
    np.testing.assert_array_equal(w, np.asarray(expected["params"]["w"]))


def test_export_onto_a_directory_fails_naming_it_and_leaves_it_as_it_was(run_dir, tmp_path):
    """OUT that is a directory is refused before anything is written, --overwrite or
    not, by a message naming OUT (not a temporary file of the export's own)."""
    out = tmp_path / "exports"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    for extra in ([], ["--overwrite"]):
        result = run("export", f"{run_dir}/0000000030", str(out), "--format", "npz", *extra)
        assert result.returncode != 0
        assert f"{out}:" in result.stderr and ".partial" not in result.stderr, result.stderr
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary file left
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"


def test_export_writes_back_the_imported_metadata_and_a_sharded_set_with_its_index(tmp_path):
    """A Hugging Face model imported, then exported: its `__metadata__` comes back
    (transformers loads no file without "format"), and a set split as transformers
    splits one, with the index naming each tensor's file, reads back as the source."""
    source = {f"model.layers.{i}.weight": np.full((64, 64), i, np.float32) for i in range(5)}  # 16 KiB each
    safetensors.numpy.save_file(source, str(tmp_path / "model.safetensors"), metadata={"format": "pt", "x": "y"})
    zarrckpt.import_checkpoint(str(tmp_path / "model.safetensors"), str(tmp_path / "ckpt"))
    out = tmp_path / "out"
    out.mkdir()
    result = run("export", str(tmp_path / "ckpt"), str(out / "model.safetensors"), "--max-shard-bytes", "40000")
    assert result.returncode == 0, result.stderr
    files = sorted(p.name for p in out.iterdir())
    assert files == ["model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                     "model-00003-of-00003.safetensors", "model.safetensors.index.json"]  # 2 + 2 + 1 tensors
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 5 * 64 * 64 * 4
    assert index["weight_map"]["model.layers.4.weight"] == "model-00003-of-00003.safetensors"
    for name in files[:3]:
        with safetensors.safe_open(str(out / name), "np") as f:
            assert f.metadata() == {"format": "pt", "x": "y"}
    back = zarrckpt.load_safetensors(str(out))  # through the index
    for i in range(5):
        np.testing.assert_array_equal(back["model"]["layers"][str(i)]["weight"], source[f"model.layers.{i}.weight"])
    # A checkpoint that came from elsewhere is marked as transformers expects; a set that
    # fits in one file is that one file.
    zarrckpt.save_pytree(str(tmp_path / "plain"), {"w": np.ones(3, np.float32)})
    one = zarrckpt.export_checkpoint(str(tmp_path / "plain"), str(out / "plain.safetensors"), max_shard_bytes=40000)
    assert one.url == str(out / "plain.safetensors")
    with safetensors.safe_open(one.url, "np") as f:
        assert f.metadata() == {"format": "pt"}
    with pytest.raises(FileExistsError, match="model-00001-of-00003.safetensors already exists"):
        zarrckpt.export_checkpoint(str(tmp_path / "ckpt"), str(out / "model.safetensors"), max_shard_bytes=40000)
    with pytest.raises(ValueError, match="max_shard_bytes splits a .safetensors export"):
        zarrckpt.export_checkpoint(str(tmp_path / "ckpt"), str(out / "m.npz"), max_shard_bytes=40000)


def test_export_refuses_what_the_format_cannot_hold(tmp_path):
    url = str(tmp_path / "c")
    zarrckpt.save_pytree(url, {"z": np.ones(2, np.complex128), "i4": np.arange(3).astype(ml_dtypes.int4)})
    with pytest.raises(ValueError, match="complex128, which safetensors cannot hold"):
        zarrckpt.export_checkpoint(url, str(tmp_path / "x.safetensors"))
    assert not (tmp_path / "x.safetensors").exists() and not (tmp_path / "x.safetensors.partial").exists()
    result = zarrckpt.export_checkpoint(url, str(tmp_path / "x.npz"))
    assert result.widened == {"i4": ("int4", "int8")}
    with np.load(tmp_path / "x.npz") as arrays:
        np.testing.assert_array_equal(arrays["i4"], np.arange(3, dtype=np.int8))


def test_export_select_writes_a_subtree_named_inside_it_and_leaves_out_text(tmp_path):
    url = str(tmp_path / "c")
    tree = {"params": {"encoder": {"w": np.ones((2, 3), np.float32)}, "head": np.arange(4, dtype=np.int32)},
            "opt_state": {"mu": np.zeros(3)}, "config": "layers=2", "vocab": b"\x00\x01",
            "data": zarrckpt.PerProcess({"next": 3})}
    zarrckpt.save_pytree(url, tree)
    params, whole = run_together([["export", url, str(tmp_path / "params.safetensors"), "--select", "params"],
                                  ["export", url, str(tmp_path / "all.npz")]])
    assert params.returncode == 0, params.stderr
    tensors = safetensors.numpy.load_file(str(tmp_path / "params.safetensors"))  # as a Hugging Face user reads it
    assert sorted(tensors) == ["encoder.w", "head"]  # named inside the subtree
    assert tensors["encoder.w"].dtype == np.float32 and np.array_equal(tensors["encoder.w"], np.ones((2, 3)))
    assert tensors["head"].dtype == np.int32 and tensors["head"].tolist() == [0, 1, 2, 3]
    assert whole.returncode == 0, whole.stderr
    with np.load(tmp_path / "all.npz") as arrays:
        assert sorted(arrays.files) == ["opt_state.mu", "params.encoder.w", "params.head"]  # no text turned to uint8
    for name, why in (("config", "a str, not an array of numbers"), ("vocab", "a bytes, not an array of numbers"),
                      ("data", "a per-process value, not an array")):
        assert f"  {name}: left out ({why})" in whole.stdout, whole.stdout
    result = zarrckpt.export_checkpoint(url, str(tmp_path / "w.npz"), select="params.encoder.w")
    assert (result.leaves, result.skipped) == (1, {})
    with np.load(tmp_path / "w.npz") as arrays:
        assert arrays.files == ["w"]
    missing = run("export", url, str(tmp_path / "x.npz"), "--select", "parms")
    assert missing.returncode == 1 and "select 'parms' names no subtree" in missing.stderr
    assert "config, data, opt_state, params, vocab" in missing.stderr and not (tmp_path / "x.npz").exists()


@pytest.mark.parametrize(("args", "complaint", "hint"), [
    (["gc", "D", "--keep_last", "2"], "unrecognized arguments: --keep_last 2",
     "--keep_last is not an option of zarrckpt gc: did you mean --keep-last?"),
    (["gc", "D", "--keep-last", "2", "--dryrun"], "unrecognized arguments: --dryrun",
     "--dryrun is not an option of zarrckpt gc: did you mean --dry-run?"),
])
def test_a_mistyped_flag_gets_the_commands_usage_and_the_flag_it_resembles(args, complaint, hint):
    # In-process: the whole of what the user sees is the parser's output, no JAX needed.
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = _cli.main(args)
    lines = err.getvalue().splitlines()
    assert status == 2 and lines[0].startswith("usage: zarrckpt gc ")  # gc's usage, not the top level's
    assert f"zarrckpt gc: error: {complaint}" in lines and f"  {hint}" in lines, lines


def test_a_storage_option_for_a_local_path_is_refused_in_the_flags_words(tmp_path):
    import contextlib
    import io

    zarrckpt.save_pytree(str(tmp_path / "src"), {"a": np.ones(3)})
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = _cli.main(["ls", str(tmp_path), "-o", "anon=true"])
    assert status == 1 and "--storage-option ['anon'] do nothing for the local path" in err.getvalue()
    # With two URLs, -o is for the remote side: a local side takes none of it.
    with contextlib.redirect_stdout(io.StringIO()):
        assert _cli.main(["cp", str(tmp_path / "src"), str(tmp_path / "dst"), "-o", "anon=true"]) == 0
    with contextlib.redirect_stderr(io.StringIO()) as err:
        status = _cli.main(["cp", str(tmp_path / "src"), str(tmp_path / "dst2"), "--dst-storage-option", "anon=true"])
    assert status == 1 and "--dst-storage-option ['anon']" in err.getvalue()


def test_errors_are_one_line(tmp_path):
    missing, debug, usage = run_together([["info", str(tmp_path / "nothing")],
                                          ["info", str(tmp_path / "nothing"), "--debug"],
                                          ["gc", str(tmp_path), "--keep-last", "0"]])
    assert missing.returncode == 1
    assert missing.stderr == f"zarrckpt: error: no checkpoint at {tmp_path / 'nothing'}\n"
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "CheckpointNotFoundError" in debug.stderr
    assert usage.returncode == 2 and "expected a positive integer" in usage.stderr


def test_storage_option_values():
    assert _cli._option("anon=true") == ("anon", True)
    assert _cli._option("endpoint_url=http://127.0.0.1:9000") == ("endpoint_url", "http://127.0.0.1:9000")
    assert _cli._option('client_kwargs={"region_name": "eu-west-1"}') == ("client_kwargs",
                                                                          {"region_name": "eu-west-1"})
    assert _cli._option("token=") == ("token", "")
    size = _commands._size
    assert size(512) == "512 B" and size(1536) == "1.5 KiB" and size(3 * 2**30) == "3.0 GiB"


def installed_command() -> str | None:
    """The `zarrckpt` script of the running interpreter's environment, if installed."""
    beside = Path(sysconfig.get_path("scripts")) / "zarrckpt"
    return str(beside) if beside.exists() else None


@pytest.mark.skipif(installed_command() is None, reason="zarrckpt is not installed in this environment")
def test_installed_entry_point(run_dir):
    listed = run("ls", run_dir, "--json", command=[installed_command()])
    assert listed.returncode == 0, listed.stderr
    assert [row["step"] for row in json.loads(listed.stdout)] == [10, 20, 30, 40]


def test_ls_counts_a_seqax_step(tmp_path):
    """seqax's layout has no tree record: `ls` counts its leaves and bytes from the arrays."""
    from test_seqax import seqax_save_zarr

    seqax_save_zarr(str(tmp_path), 5, {"w": jnp.arange(6.0, dtype=jnp.float32), "b": jnp.ones(2, jnp.int32)})
    listed = run("ls", str(tmp_path))
    assert listed.returncode == 0, listed.stderr
    rows = [line.split() for line in listed.stdout.splitlines()]
    assert rows[1][:5] == ["5", "committed", "32", "B", "2"]  # 24 + 8 bytes of data, 2 leaves


def test_errors_speak_the_command_lines_words(run_dir, tmp_path):
    """Advice names flags, not Python keywords; nothing shows a temporary name."""
    src = f"{run_dir}/0000000030"
    taken, directory, folder, extension, absent, uncommitted = run_together([
        ["cp", src, f"{run_dir}/0000000020"], ["info", run_dir], ["export", src, str(tmp_path / "no" / "x.npz")],
        ["export", src, str(tmp_path / "x.pt")], ["ls", str(tmp_path / "nothing")],
        ["cp", f"{run_dir}/0000000040", str(tmp_path / "copy")]])
    assert taken.returncode == 1 and "pass --overwrite to replace it" in taken.stderr
    assert directory.returncode == 1 and f"give one step's URL, the newest {run_dir}/0000000040" in directory.stderr
    assert folder.returncode == 1 and f"the folder {tmp_path / 'no'} does not exist" in folder.stderr
    assert ".partial" not in folder.stderr
    assert extension.returncode == 1 and "--format npz or --format safetensors" in extension.stderr
    assert absent.returncode == 1 and absent.stderr == f"zarrckpt: error: {tmp_path / 'nothing'} does not exist\n"
    assert uncommitted.returncode == 1 and "pass --allow-uncommitted to copy it as it is" in uncommitted.stderr
    for result in (taken, directory, folder, extension, absent, uncommitted):
        assert "=True" not in result.stderr and "load_checkpoint" not in result.stderr, result.stderr


def test_cp_of_a_damaged_checkpoint_commits_nothing_and_names_the_damage(run_dir, tmp_path):
    src = f"{run_dir}/0000000030"
    chunk = next(p for p in Path(src).rglob("c.*") if "params.w" in str(p))
    data = bytearray(chunk.read_bytes())
    data[0] ^= 1
    chunk.write_bytes(bytes(data))
    flipped = run("cp", src, str(tmp_path / "a"))
    assert flipped.returncode == 1 and f"{chunk.relative_to(src)}' of checkpoint {src} fails its CRC-32C" in \
        flipped.stderr
    chunk.unlink()
    assert not zarrckpt.metadata(str(tmp_path / "a")).committed  # found while copying: a partial copy
    missing = run("cp", src, str(tmp_path / "b"))
    assert missing.returncode == 1 and f"{chunk.relative_to(src)}' is missing" in missing.stderr
    assert not (tmp_path / "b").exists()  # found by the listing, before anything is written


def test_info_of_many_leaves_shows_totals_first_a_subtree_or_a_summary(tmp_path):
    url = str(tmp_path / "c")
    tree = {"params": {f"layer{i}": {"w": np.ones((4, 4), np.float32), "b": np.ones(4, np.float32)}
                       for i in range(3)}, "opt_state": {"mu": np.zeros(16)}, "step": 3}
    zarrckpt.save_pytree(url, tree)
    whole, layer, summary, deeper = run_together([["info", url], ["info", url, "--select", "params.layer1"],
                                                  ["info", url, "--summary"],
                                                  ["info", url, "--summary", "--select", "params"]])
    for result in (whole, layer, summary, deeper):
        assert result.returncode == 0, result.stderr
        assert result.stdout.splitlines()[0].endswith(", 8 leaves, 376 B")  # the totals first, whatever is shown
    assert [line.split()[0] for line in layer.stdout.splitlines()[2:-1]] == ["params.layer1.b", "params.layer1.w"]
    assert layer.stdout.splitlines()[-1] == "params.layer1: 2 leaves, 80 B"
    assert [line.split() for line in summary.stdout.splitlines()[2:]] == [
        ["opt_state", "1", "128", "B"], ["params", "6", "240", "B"], ["step", "1", "8", "B"]]
    assert [line.split()[:2] for line in deeper.stdout.splitlines()[2:-1]] == [
        ["params.layer0", "2"], ["params.layer1", "2"], ["params.layer2", "2"]]
    wrong = run("info", url, "--select", "param")
    assert wrong.returncode == 1 and "select 'param' names no subtree" in wrong.stderr


def test_info_says_a_typed_key_is_a_key(run_dir):
    table = run("info", f"{run_dir}/0000000030")
    assert table.returncode == 0
    row = next(line for line in table.stdout.splitlines() if line.startswith("rng"))
    assert "key<threefry2x32> data (uint32)" in row
