"""Training loops written the way flax NNX, equinox and plain jax + grain document them,
checkpointed with zarrckpt.CheckpointManager, stopped, and resumed in a new process,
end bit-identical to an uninterrupted run (tests/workers/user_loops.py has the loops).

Every loop saves with `mgr.save(step, state, metrics={"loss": loss})`, `loss` straight
from the jitted step (a jax scalar), and restores at start-up with
`state, step = mgr.restore(target)`. The checks:

  - flax NNX: `nnx.state((model, optimizer))` saved, restored into the abstract state
    of a freshly built (model, optimizer) and put back with `nnx.update`;
  - equinox: `eqx.filter(model, eqx.is_array)` and the optax state saved; the restore
    into the model's own arrays leaves the model usable (nothing donated by default);
  - plain jax + grain: the grain iterator's position saved as `zarrckpt.PerProcess`,
    so the resumed run sees the same next batches;
  - two processes of one jax.distributed job, each with its own grain shard: each
    restores its own position; one process cannot load them unless it says
    `PerProcess(None, strict=False)`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from multiprocess import run

import zarrckpt

REPO = Path(__file__).parent.parent
WORKER = Path(__file__).parent / "workers" / "user_loops.py"


def train(loop: str, total: int, *runs: tuple[Path, int, Path]) -> list[dict[str, np.ndarray]]:
    """Runs `loop` in a new process, for each of `runs` (ckpt_dir, stop_at, out) in turn
    from the newest step committed in `ckpt_dir` up to `stop_at`; returns what the worker
    wrote for each (see tests/workers/user_loops.py)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               XLA_FLAGS="--xla_force_host_platform_device_count=1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    (ckpt_dir, stop_at, out), *more = runs
    args = [loop, str(ckpt_dir), str(stop_at), str(total), str(out)]
    args += [str(arg) for run in more for arg in run]
    proc = subprocess.run([sys.executable, str(WORKER), *args], env=env, capture_output=True, text=True,
                          timeout=120 * len(runs))
    assert proc.returncode == 0, (f"the {loop} loop ({' '.join(args)}) exited {proc.returncode}:\n"
                                  f"{proc.stdout}{proc.stderr}")
    results = []
    for _, _, out in runs:
        with np.load(out) as saved:
            results.append(dict(saved))
    return results


def interrupted_and_straight(loop: str, tmp_path: Path, stop_at: int, total: int):
    """(uninterrupted run to `total`, first run to `stop_at`, second run resumed to `total`);
    the interrupted pair shares one checkpoint directory, and the second run is a new
    process (the first two share one: each starts from nothing of the other's)."""
    straight, first = train(loop, total, (tmp_path / "straight", total, tmp_path / "straight.npz"),
                            (tmp_path / "interrupted", stop_at, tmp_path / "first.npz"))
    (resumed,) = train(loop, total, (tmp_path / "interrupted", total, tmp_path / "resumed.npz"))
    return straight, first, resumed


def params_of(result: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v for k, v in result.items() if k.startswith("param/")}


def assert_bit_identical(resumed: dict[str, np.ndarray], straight: dict[str, np.ndarray], what: str) -> None:
    assert resumed.keys() == straight.keys(), f"{what}: different leaves: {sorted(resumed)} vs {sorted(straight)}"
    assert resumed, f"{what}: nothing to compare"
    for key in straight:
        assert resumed[key].dtype == straight[key].dtype, f"{what}: {key} has dtype {resumed[key].dtype}, " \
                                                          f"not {straight[key].dtype}"
        assert np.array_equal(resumed[key], straight[key]), f"{what}: {key} differs from the uninterrupted run's"


def assert_resumed(first, resumed, *, first_saved, resumed_from, resumed_saved, committed) -> None:
    assert first["resumed_from"] == 0, f"the first run did not start from scratch (step {first['resumed_from']})"
    assert first["saved"].tolist() == first_saved, f"the first run saved steps {first['saved'].tolist()}"
    assert resumed["resumed_from"] == resumed_from, (
        f"the second process resumed from step {resumed['resumed_from']}, not the newest committed {resumed_from}")
    assert resumed["saved"].tolist() == resumed_saved, f"the resumed run saved steps {resumed['saved'].tolist()}"
    assert resumed["committed"].tolist() == committed, f"steps left on disk: {resumed['committed'].tolist()}"


def assert_losses_recorded(ckpt_dir: Path, result: dict[str, np.ndarray]) -> None:
    """Each step the run saved holds, as metric "loss", the jax scalar its train step
    returned (the group attribute of docs/pytree-zarr-checkpoint.md), if retention kept it."""
    for step in sorted(set(result["saved"].tolist()) & set(result["committed"].tolist())):
        group = json.loads((ckpt_dir / f"{step:010d}" / "zarr.json").read_text())
        recorded = group["attributes"]["zarrckpt"]["metrics"]["loss"]
        assert recorded == float(result[f"loss/{step}"]), f"step {step} recorded loss {recorded}, " \
                                                          f"the step returned {result[f'loss/{step}']}"


def test_flax_nnx_loop_resumed_in_a_new_process_ends_bit_identical(tmp_path):
    # CheckpointManager(dir, keep_last=2): no save policy, so every step is saved.
    straight, first, resumed = interrupted_and_straight("nnx", tmp_path, stop_at=3, total=6)

    assert_resumed(first, resumed, first_saved=[1, 2, 3], resumed_from=3, resumed_saved=[4, 5, 6],
                   committed=[5, 6])
    assert_bit_identical(params_of(resumed), params_of(straight), "nnx parameters after resuming at step 3")
    assert_losses_recorded(tmp_path / "interrupted", resumed)


def test_equinox_loop_resumed_in_a_new_process_ends_bit_identical(tmp_path):
    # save_interval_steps=2 and a stop at 5: the second process restores step 4 and
    # trains step 5 again. Its restore into eqx.filter(model, eqx.is_array) must leave
    # the freshly built model callable (the worker checks, and fails if not).
    straight, first, resumed = interrupted_and_straight("equinox", tmp_path, stop_at=5, total=6)

    assert_resumed(first, resumed, first_saved=[2, 4], resumed_from=4, resumed_saved=[6], committed=[2, 4, 6])
    assert_bit_identical(params_of(resumed), params_of(straight), "equinox parameters after resuming at step 4")
    assert np.array_equal(first["loss/5"], resumed["loss/5"]), "step 5 trained again gave another loss"
    assert_losses_recorded(tmp_path / "interrupted", resumed)


def test_jax_grain_loop_resumes_at_the_same_batch_and_ends_bit_identical(tmp_path):
    # save_interval_steps=2, keep_last=2; the grain iterator's position is a PerProcess leaf.
    straight, first, resumed = interrupted_and_straight("grain", tmp_path, stop_at=5, total=8)

    assert_resumed(first, resumed, first_saved=[2, 4], resumed_from=4, resumed_saved=[6, 8], committed=[6, 8])
    for step in range(5, 9):
        for part in ("x", "y"):
            key = f"batch/{step}/{part}"
            assert np.array_equal(resumed[key], straight[key]), \
                f"after resuming at step 4, step {step}'s batch {part} differs from the uninterrupted run's"
    assert np.array_equal(first["batch/5/x"], resumed["batch/5/x"]), "step 5 trained again on another batch"
    assert_bit_identical(params_of(resumed), params_of(straight), "jax parameters after resuming at step 4")
    assert_losses_recorded(tmp_path / "interrupted", resumed)


@pytest.fixture(scope="module")
def two_process_checkpoint(tmp_path_factory):
    """A checkpoint directory saved by a 2-process job whose processes stood at
    different positions of their own grain shards, and what each process reported."""
    ckpt_dir = tmp_path_factory.mktemp("two_process") / "ckpt"
    results = run("user_loops", "shards", str(ckpt_dir), processes=2, devices=2)
    return ckpt_dir, results


def test_each_process_restores_its_own_grain_position(two_process_checkpoint):
    _, results = two_process_checkpoint
    for pid, result in enumerate(results):
        assert result["step"] == 3, f"process {pid} restored step {result['step']}"
        assert result["restored_type"] == "PerProcess", f"process {pid} got a {result['restored_type']} back"
        assert result["restored_state"] == result["saved_state"], (
            f"process {pid} saved position {result['saved_state']} and restored {result['restored_state']}")
        assert result["next_batch_matches"], f"process {pid}'s iterator, set to the restored position, " \
                                             "yields another batch than the one it would have"
        assert result["w_matches"], f"process {pid}'s shards of w differ after the restore"
    positions = [result["saved_state"] for result in results]
    assert positions[0] != positions[1], f"the processes were meant to stand at different positions: {positions}"


def test_one_process_cannot_load_two_processes_positions_unless_not_strict(two_process_checkpoint):
    ckpt_dir, _ = two_process_checkpoint

    w = np.zeros(8, np.float32)  # 2 processes x 2 devices x 2 values
    with pytest.raises(zarrckpt.CheckpointMismatchError, match=r"\['data'\]"):
        zarrckpt.load_checkpoint(str(ckpt_dir), 3, {"data": zarrckpt.PerProcess(None), "w": w})

    restored = zarrckpt.load_checkpoint(str(ckpt_dir), 3, {"data": zarrckpt.PerProcess(None, strict=False), "w": w})
    assert restored["data"] == zarrckpt.PerProcess(None, strict=False), \
        f"a non-strict target leaf should come back unchanged, got {restored['data']!r}"
    assert np.array_equal(restored["w"], np.arange(8.0, dtype=np.float32)), f"w restored as {restored['w']}"
