"""The command's first-hour edges: what a new user meets first (a missing step, `cp`
into a folder or from a live run, help, sizes, counts) says what happened and what to do."""

import contextlib
import io
import json
import logging
import os
import stat

import jax
import numpy as np
import pytest
import safetensors
from forked_cli import run, run_together

import zarrckpt
from zarrckpt import _cli, _copy, _storage
from zarrckpt._run import retention as _retention
from zarrckpt._util import progress as _progress


def cli(*argv: str) -> tuple[int, str, str]:
    """The command in this process (where a test's manager holds a run): status, stdout, stderr."""
    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.redirect_stderr(io.StringIO()) as err:
        status = _cli.main(list(argv))
    return status, out.getvalue(), err.getvalue()


@pytest.fixture
def run_dir(tmp_path) -> str:
    root = str(tmp_path / "runs" / "a")
    for step in (10, 20):
        zarrckpt.save_checkpoint(root, step, {"w": np.ones(3, np.float32), "rng": jax.random.key(step)})
    return root


def test_a_missing_step_lists_the_committed_ones_and_ls_of_a_parent_points_at_its_runs(run_dir, tmp_path):
    zarrckpt.save_checkpoint(str(tmp_path / "runs" / "b"), 5, {"w": np.ones(2)})
    ls_step, info, verify, export, parent = run_together([
        ["ls", f"{run_dir}/123"], ["info", f"{run_dir}/0000000015"], ["verify", f"{run_dir}/20"],
        ["export", f"{run_dir}/0000000030", str(tmp_path / "x.npz")], ["ls", str(tmp_path / "runs")]])
    for result in (ls_step, info, verify, export):
        assert result.returncode == 1 and f"({run_dir} holds 2 committed steps: 10, 20; " in result.stderr, \
            result.stderr
    assert f"the newest is {run_dir}/0000000020)" in info.stderr
    assert f"did you mean {run_dir}/0000000020?" in verify.stderr or f"{run_dir}/0000000020" in verify.stderr
    assert parent.returncode == 0, parent.stderr
    lines = parent.stdout.splitlines()
    assert "directories of steps below it" in lines[0]
    assert [line.split() for line in lines[2:]] == [[run_dir, "2", "20"], [str(tmp_path / "runs" / "b"), "1", "5"]]


def test_cp_into_a_folder_named_with_a_slash_puts_the_copy_inside_it(run_dir, tmp_path):
    copied = run("cp", f"{run_dir}/0000000020", f"{tmp_path}/backup/")
    assert copied.returncode == 0, copied.stderr
    assert zarrckpt.verify(f"{tmp_path}/backup/0000000020").ok
    assert f"to {tmp_path}/backup/0000000020 " in copied.stdout


def test_cp_from_a_live_run_names_its_retention_and_pin_holds_the_step(run_dir, tmp_path, monkeypatch):
    mgr = zarrckpt.CheckpointManager(run_dir, keep_last=2)
    original, saves = _copy._copy_all, iter([(30, 40), (50, 60)])

    def retention_meanwhile(*args, **kwargs):
        for step in next(saves, ()):  # the live job saves twice while the step is copied
            mgr.save(step, {"w": np.ones(3, np.float32), "rng": jax.random.key(step)}, force=True)
        mgr.wait()
        return original(*args, **kwargs)

    monkeypatch.setattr(_copy, "_copy_all", retention_meanwhile)
    try:
        status, _, err = cli("cp", f"{run_dir}/0000000020", str(tmp_path / "lost"))
        assert status == 1 and f"{run_dir}/0000000020 was replaced or deleted while being copied" in err, err
        assert f"a live job holds {run_dir}, and its retention deletes older steps: --pin holds" in err
        assert zarrckpt.all_steps(run_dir) == [30, 40]
        status, _, err = cli("cp", "--pin", f"{run_dir}/0000000040", str(tmp_path / "kept"))
        assert status == 0, err
        assert zarrckpt.verify(str(tmp_path / "kept")).ok
        assert zarrckpt.all_steps(run_dir) == [40, 50, 60]  # retention left the pinned step
        assert not _retention.is_pinned(_storage.resolve(run_dir).step(40))  # unpinned after the copy
    finally:
        mgr.close()


def test_cp_pin_leaves_a_pin_it_did_not_make(run_dir, tmp_path):
    step = _storage.resolve(run_dir).step(10)
    _retention.pin(step)
    copied = run("cp", "--pin", f"{run_dir}/0000000010", str(tmp_path / "c"))
    assert copied.returncode == 0, copied.stderr
    assert _retention.is_pinned(step)
    status, _, err = cli("cp", "--pin", str(tmp_path / "c"), str(tmp_path / "d"))
    assert status == 1 and "--pin holds a step of a run" in err


def test_counts_are_singular_for_one_and_format_versions_are_explained(tmp_path):
    url = str(tmp_path / "one")
    zarrckpt.save_pytree(url, {"w": np.ones(3)})
    info, verify, export = run_together([["info", url], ["verify", url], ["export", url, str(tmp_path / "o.npz")]])
    out = info.stdout + verify.stdout + export.stdout
    assert "zarrckpt format 2 (arrays only: no str, bytes or per-process leaves)" in info.stdout
    assert ", 1 leaf, 24 B" in info.stdout
    assert "1 leaf, metadata consistent, 1 chunk present with its exact size, 1 checksum matches" in verify.stdout
    assert export.stdout.startswith("exported 1 leaf ")
    assert "1 leaves" not in out and "1 chunks" not in out and "1 checksums" not in out


def test_subcommand_help_leaves_the_epilog_to_the_top_level():
    top, sub = run_together([["--help"], ["ls", "--help"]])
    assert "exit status:" in top.stdout and "FSSPEC_S3_ENDPOINT_URL" in top.stdout
    assert "exit status:" not in sub.stdout and "zarrckpt --help" in sub.stdout


def test_a_damaged_chunk_is_a_plain_message(run_dir, tmp_path):
    chunk = next(p for p in (tmp_path / "runs" / "a" / "0000000020" / "w").rglob("c*") if p.is_file())
    data = bytearray(chunk.read_bytes())
    data[0] ^= 1
    chunk.write_bytes(bytes(data))
    results = run_together([["verify", f"{run_dir}/0000000020"], ["cp", f"{run_dir}/0000000020", str(tmp_path / "x")],
                            ["export", f"{run_dir}/0000000020", str(tmp_path / "x.npz")]])
    for result in results:
        assert "fails its CRC-32C" in result.stdout + result.stderr and "DamagedChunk" not in result.stderr


def test_progress_bars_count_in_binary_units(monkeypatch):
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    monkeypatch.setattr(_progress, "_SHOW_AFTER_S", 0.0)
    with _progress.bar("copying", 3 * 2**30, True) as advance:
        advance(2 * 2**30)
    shown = err.getvalue()
    assert "/3.00G " in shown and "3.22G" not in shown and "iB/s" in shown, shown  # 3 GiB, not 3.22 GB


def test_export_modes_sizes_with_units_and_typed_keys_named(run_dir, tmp_path, caplog):
    src = f"{run_dir}/0000000020"
    with caplog.at_level(logging.WARNING, logger="zarrckpt"):
        result = zarrckpt.export_checkpoint(src, str(tmp_path / "k.safetensors"))
    assert result.key_data == {"rng": "threefry2x32"}
    assert "typed PRNG keys are written as their raw key data" in caplog.text and "rng (threefry2x32)" in caplog.text
    with safetensors.safe_open(str(tmp_path / "k.safetensors"), "np") as f:
        assert json.loads(f.metadata()["zarrckpt.key_data"]) == {"rng": "threefry2x32"}
    npz, st, sharded = run_together([["export", src, str(tmp_path / "a.npz")],
                                     ["export", src, str(tmp_path / "a.safetensors")],
                                     ["export", src, str(tmp_path / "s.safetensors"), "--max-shard-bytes", "0.01KB"]])
    assert [r.returncode for r in (npz, st, sharded)] == [0, 0, 0], npz.stderr + st.stderr + sharded.stderr
    assert "rng: a typed PRNG key (threefry2x32), written as its raw key data" in npz.stdout
    umask = os.umask(0)
    os.umask(umask)
    modes = {stat.S_IMODE(os.stat(tmp_path / name).st_mode) for name in ("a.npz", "a.safetensors")}
    assert modes == {0o666 & ~umask}
    assert (tmp_path / "s.safetensors.index.json").exists()  # 10 bytes a file: a set
    assert _cli._bytes("100KB") == 100_000 and _cli._bytes("2GiB") == 2 * 2**30 and _cli._bytes("7") == 7
    with pytest.raises(Exception, match="expected a positive size"):
        _cli._bytes("100XB")
