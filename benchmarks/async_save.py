"""What an async save costs training: how long `save` blocks, and how much longer a run of
train steps takes with one save in it. zarrckpt against Orbax's async
StandardCheckpointer and the bare copies, side by side in one run.

    python benchmarks/async_save.py                      # 1 GiB state + a 600-leaf state
    python benchmarks/async_save.py --size-gib 8 --repeats 3 --train-steps 200

Part 1, per state and round (each contender gets a new state first, as after a train
step: a state already copied once is cached on the host and flatters everyone):
- bare host copy: `np.array` of every shard a save writes (a pageable snapshot);
- pinned copy: one batched `device_put` of those shards into pinned host memory, until
  dispatched and until complete;
- zarrckpt: `CheckpointManager.save` (the time it blocks), then `wait` (until committed);
  then `save` of the same arrays again (a frozen state: its chunks made from the save
  before, nothing copied), the time it blocks;
- orbax: `StandardCheckpointer.save` (blocks), then `wait_until_finished`.
Peak host memory is the resident set above the baseline during save and wait. The first
round is reported apart (pinned host memory is allocated then), the rest as best /
median.

Part 2, training time lost per save: `--train-steps` jitted steps over the big state
(each blocks on its loss, as a loop that logs it does), once without a save and once
with one async save at step `--save-at`, with a step that donates the state and one
that does not; the loss is the difference in wall time of the steps (the save's own
background work after the last step is not counted). "pinned + thread" is the
ceiling: a batched pinned copy dispatched at the save step and written out from a
thread.

Part 3, a training loop's speed during a save: a loop of small jitted steps that blocks
on each step's loss (a Python-bound loop, as a GPU training loop's dispatch thread is)
runs alone for --loop-seconds, then beside one async save of the big state (a new state
each round) until the save has committed (zarrckpt's asked every 10 ms: waiting for it
would let it write with every thread); its steps per second beside the save over its
steps per second alone, per contender (the time `save` blocks counts as the loop's).
The loop's first save of the big state in each contender comes first, untimed.

Part 4, an unchanged state: one manager saves the big state's same values, as new
arrays each time (a frozen state a train step rebuilds), --repeats + 3 times; the time
each `save` blocks from the fourth on (by then its fingerprints are known, and the
save makes every chunk from the step before), against a bare host copy of the same
state in the same rounds.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gib", type=float, default=1.0, help="size of the big state (default 1)")
    parser.add_argument("--leaves", type=int, default=600, help="leaves of the many-leaf state (default 600)")
    parser.add_argument("--leaves-mib", type=float, default=78, help="size of the many-leaf state (default 78)")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds after the first (default 5)")
    parser.add_argument("--train-steps", type=int, default=30, help="steps per run of part 2 (0: skip it)")
    parser.add_argument("--save-at", type=int, default=10, help="the step that saves in part 2 (default 10)")
    parser.add_argument("--train-rounds", type=int, default=3, help="rounds of part 2 (default 3)")
    parser.add_argument("--loop-rounds", type=int, default=5, help="rounds of part 3 (0: skip it; default 5)")
    parser.add_argument("--loop-seconds", type=float, default=1.5,
                        help="how long part 3's loop runs alone each round (default 1.5)")
    parser.add_argument("--parts", default="1,2,3,4", help="which parts to run (default 1,2,3,4)")
    parser.add_argument("--only", default="zarrckpt,orbax", help="contenders (default zarrckpt,orbax)")
    parser.add_argument("--no-bare-copy", action="store_true",
                        help="skip the bare copy to numpy (on a GPU, 8 GiB of it took 8-13 s a round)")
    parser.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None,
                        help="where to write: in a new directory made there and removed at the end, nothing else "
                             "in it touched (default /dev/shm)")
    _common.add_platform_arguments(parser)
    return parser.parse_args(argv)


# -- part 1 ----------------------------------------------------------------------------------


class ZarrckptAsync:
    name = "zarrckpt"

    def __init__(self, base: str) -> None:
        import zarrckpt

        self.mgr = zarrckpt.CheckpointManager(os.path.join(base, "zarrckpt"), keep_last=1)
        self.step = 0

    def save(self, state) -> None:
        self.step += 1
        self.mgr.save(self.step, state, force=True)

    def wait(self) -> None:
        self.mgr.wait()

    def committed(self) -> bool:
        """Whether the last save has committed, asked without waiting for it (a wait
        lets a save write with all its threads: the caller is not training then)."""
        return self.mgr.latest_step() == self.step

    def close(self) -> None:
        self.mgr.close()


class OrbaxAsync:
    name = "orbax"

    def __init__(self, base: str) -> None:
        import orbax.checkpoint as ocp

        self.checkpointer = ocp.StandardCheckpointer()
        self.base = os.path.join(base, "orbax")
        self.step = 0

    def save(self, state) -> None:
        self.step += 1
        shutil.rmtree(os.path.join(self.base, str(self.step - 2)), ignore_errors=True)  # keep the disk small
        self.checkpointer.save(os.path.join(self.base, str(self.step)), state)

    def wait(self) -> None:
        self.checkpointer.wait_until_finished()

    def close(self) -> None:
        self.checkpointer.close()


class PinnedAndThread:
    """The ceiling of an async save: a batched pinned copy, written by a thread."""

    name = "pinned + thread"

    def __init__(self, base: str) -> None:
        self.base = os.path.join(base, "raw")
        os.makedirs(self.base, exist_ok=True)
        self.thread: threading.Thread | None = None

    def save(self, state) -> None:
        _, _, copies = _common.pinned_copy(state, wait=False)
        self.thread = threading.Thread(target=self._write, args=(copies,))
        self.thread.start()

    def _write(self, copies) -> None:
        import concurrent.futures

        import numpy as np

        with concurrent.futures.ThreadPoolExecutor(_common.writer_threads()) as pool:
            list(pool.map(lambda item: np.asarray(item[1]).tofile(os.path.join(self.base, f"{item[0]}.bin")),
                          enumerate(copies)))

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()

    def close(self) -> None:
        self.wait()


CONTENDERS = {"zarrckpt": ZarrckptAsync, "orbax": OrbaxAsync}


def part1(name: str, tree, contenders, repeats: int, bare: bool = True) -> dict:
    nbytes = _common.tree_nbytes(tree)
    import jax

    print(f"\n{name}: {nbytes / 2**30:.3f} GiB in {len(jax.tree.leaves(tree))} leaves", flush=True)
    rows: dict[str, list[float]] = {}
    first: dict[str, float] = {}

    def record(key: str, value: float, r: int) -> None:
        if r == 0:
            first[key] = value
        else:
            rows.setdefault(key, []).append(value)

    for r in range(repeats + 1):
        line = []
        if bare:
            record("bare copy", copy_s := _common.bare_copy(_common.fresh(tree)), r)
            line.append(f"bare {copy_s:.3f}s")
        dispatched, done, copies = _common.pinned_copy(_common.fresh(tree))
        del copies
        record("pinned dispatched", dispatched, r)
        record("pinned complete", done, r)
        line.append(f"pinned {dispatched:.3f}/{done:.3f}s")
        for contender in contenders:
            state = _common.fresh(tree, r + 1)  # changed, as by a train step: nothing to reuse
            with _common.PeakMemory() as memory:
                started = time.perf_counter()
                contender.save(state)
                blocked = time.perf_counter() - started
                contender.wait()
                total = time.perf_counter() - started
            record(f"{contender.name} blocked", blocked, r)
            record(f"{contender.name} total", total, r)
            record(f"{contender.name} peak MiB", memory.above / 2**20, r)
            line.append(f"{contender.name} blocked {blocked:.3f}s total {total:.3f}s "
                        f"+{memory.above / 2**20:.0f} MiB")
            if contender.name == "zarrckpt":  # the same arrays again, as a frozen state is: made from the save before
                started = time.perf_counter()
                contender.save(state)
                again = time.perf_counter() - started
                contender.wait()
                record("zarrckpt blocked, unchanged", again, r)
                line.append(f"unchanged {again:.3f}s")
            del state
        print(f"  {'first' if r == 0 else f'round {r}'}: " + "; ".join(line), flush=True)
    print(f"  {'':28} {'first':>9}   best / median of {repeats}")
    for key, values in rows.items():
        unit = "MiB" if key.endswith("MiB") else "s"
        digits = 0 if unit == "MiB" else 3
        print(f"  {key:28} {first[key]:9.{digits}f}   {_common.fmt(values, unit, digits)}")
    medians = {key: statistics.median(values) for key, values in rows.items()}
    for contender in contenders:
        blocked = medians[f"{contender.name} blocked"]
        versus_bare = f"blocked / bare copy {blocked / medians['bare copy']:.2f}, " if bare else ""
        versus_pinned = blocked / medians["pinned complete"]
        print(f"  {contender.name}: {versus_bare}blocked / pinned copy complete {versus_pinned:.2f}")
    if "zarrckpt blocked" in medians and "orbax blocked" in medians:
        print(f"  zarrckpt blocked / orbax blocked: {medians['zarrckpt blocked'] / medians['orbax blocked']:.2f}")
    return {"first": first, "rounds": rows}


# -- part 2 ----------------------------------------------------------------------------------


def _train_step(donate: bool):
    import jax
    import jax.numpy as jnp

    def step(state):
        new = jax.tree.map(lambda x: x * 0.9999 + 1e-4 if jnp.issubdtype(x.dtype, jnp.floating) else x + 1, state)
        loss = sum(jnp.mean(x) for x in jax.tree.leaves(new) if jnp.issubdtype(x.dtype, jnp.floating))
        return new, loss

    return jax.jit(step, donate_argnums=0 if donate else ())


def _run_steps(step_fn, state, steps: int, save_at: int, save) -> tuple[float, object]:
    started = time.perf_counter()
    for i in range(steps):
        state, loss = step_fn(state)
        loss.block_until_ready()  # a loop that logs its loss waits for each step
        if save is not None and i == save_at:
            save(state)
    seconds = time.perf_counter() - started
    return seconds, state


def part2(tree, contenders, steps: int, save_at: int, rounds: int) -> dict:
    import jax

    print(f"\ntraining time lost per save: {steps} steps, one async save at step {save_at}", flush=True)
    results = {}
    for donate in (True, False):
        step_fn = _train_step(donate)
        jax.block_until_ready(_run_steps(step_fn, _common.fresh(tree), 2, -1, None)[1])  # compile
        lost: dict[str, list[float]] = {}
        step_times = []
        for r in range(rounds):
            base, state = _run_steps(step_fn, _common.fresh(tree), steps, -1, None)
            del state
            step_times.append(base / steps)
            for contender in contenders:
                # Each round from other values, as a training run's saves are: a state equal
                # to the one a manager saved last round is found unchanged (`reuse_unchanged`)
                # and not written, which timed fingerprints instead of a save (the H200's
                # 0.26-1.53 s lost per save, 2026-11-27).
                seconds, state = _run_steps(step_fn, _common.fresh(tree, r + 1), steps, save_at, contender.save)
                contender.wait()
                del state
                lost.setdefault(contender.name, []).append(seconds - base)
            print(f"  {'donating' if donate else 'not donating'} round {r + 1}: step "
                  f"{base / steps * 1e3:.1f} ms; lost " + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in lost.items()),
                  flush=True)
        key = "donating" if donate else "not donating"
        results[key] = lost
        print(f"  {key} (step {statistics.median(step_times) * 1e3:.1f} ms): "
              + "; ".join(f"{k} {_common.fmt(v)}" for k, v in lost.items()))
    return results


# -- part 3 ----------------------------------------------------------------------------------


def _small_step():
    """A small model's jitted train step on one device: a Python-bound loop of these is
    what a save's threads compete with."""
    import jax
    import jax.numpy as jnp

    def loss_fn(params, x):
        h = x
        for w in params:
            h = jnp.tanh(h @ w)
        return jnp.mean(h * h)

    @jax.jit
    def step(params, x):
        loss, grads = jax.value_and_grad(loss_fn)(params, x)
        return [w - 1e-3 * g for w, g in zip(params, grads)], loss

    keys = jax.random.split(jax.random.key(0), 5)
    params = [jax.random.normal(k, (128, 128)) * 0.05 for k in keys[:4]]
    x = jax.random.normal(keys[4], (16, 128))
    return step, params, x


def _loop(step, params, x, until) -> tuple[int, float, object]:
    """Steps (each waiting for its loss) until `until()`; returns (steps, seconds, params)."""
    started, n = time.perf_counter(), 0
    while not until():
        params, loss = step(params, x)
        loss.block_until_ready()
        n += 1
    return n, time.perf_counter() - started, params


def part3(tree, contenders, rounds: int, seconds: float) -> dict:
    step, params, x = _small_step()
    _, _, params = _loop(step, params, x, _after(0.2))  # compiled, warm
    print(f"\ntraining loop beside a save: small jitted steps, {seconds:.1f} s alone, then beside one async save "
          f"of {_common.tree_nbytes(tree) / 2**30:.2f} GiB until it commits", flush=True)
    for contender in contenders:  # each contender's first save of this state, untimed
        contender.save(_common.fresh(tree, 100))
        contender.wait()
    ratios: dict[str, list[float]] = {}
    for r in range(rounds):
        line = []
        for contender in contenders:
            state = _common.fresh(tree, 200 + r)
            alone, alone_s, params = _loop(step, params, x, _after(seconds))
            done = threading.Event()
            started = time.perf_counter()
            contender.save(state)
            waiter = threading.Thread(target=_until_committed, args=(contender, done))
            waiter.start()
            beside, _, params = _loop(step, params, x, done.is_set)
            waiter.join()
            took = time.perf_counter() - started
            ratio = (beside / took) / (alone / alone_s)
            ratios.setdefault(contender.name, []).append(ratio)
            line.append(f"{contender.name} {ratio:.2f}x ({alone / alone_s:.0f} steps/s alone, "
                        f"{beside / took:.0f} beside a save of {took:.2f}s)")
            del state
        print(f"  round {r + 1}: " + "; ".join(line), flush=True)
    for name, values in ratios.items():
        best, median = max(values), statistics.median(values)
        print(f"  {name}: speed beside a save / alone, best {best:.2f}x, median {median:.2f}x")
    return ratios


# -- part 4 ----------------------------------------------------------------------------------


def part4(tree, base: str, repeats: int) -> dict:
    import zarrckpt

    print(f"\nunchanged state: the same values as new arrays, {_common.tree_nbytes(tree) / 2**30:.2f} GiB", flush=True)
    blocked, bare = [], []
    with zarrckpt.CheckpointManager(os.path.join(base, "unchanged"), keep_last=1) as mgr:
        for i in range(repeats + 3):
            state = _common.fresh(tree, 300)
            started = time.perf_counter()
            mgr.save(i, state, force=True)
            seconds = time.perf_counter() - started
            mgr.wait()
            if i >= 3:
                blocked.append(seconds)
                bare.append(_common.bare_copy(_common.fresh(tree, 300)))
            del state
    print(f"  zarrckpt save blocked {_common.fmt(blocked)}; bare host copy {_common.fmt(bare)}; "
          f"blocked / bare copy {statistics.median(blocked) / statistics.median(bare):.2f} (medians)")
    return {"blocked": blocked, "bare copy": bare}


def _until_committed(contender, done: threading.Event) -> None:
    """Sets `done` once `contender`'s save has committed: asked every 10 ms where the
    contender can tell without waiting, else by waiting for it."""
    if hasattr(contender, "committed"):
        while not contender.committed():
            time.sleep(0.01)
    contender.wait()
    done.set()


def _after(seconds: float):
    deadline = time.perf_counter() + seconds
    return lambda: time.perf_counter() >= deadline


def main() -> None:
    args = parse_args()
    _common.setup_platform(args.platform, args.devices)
    import jax

    names = [n.strip() for n in args.only.split(",") if n.strip()]
    base = tempfile.mkdtemp(prefix="zarrckpt-async-", dir=args.dir)
    mesh = _common.make_mesh()
    print(f"jax {jax.__version__} on {_common.describe_platform()}; writing to {base}", flush=True)
    contenders = [CONTENDERS[n](base) for n in names]
    try:
        parts = {p.strip() for p in args.parts.split(",")}
        big = _common.build_tree(args.size_gib, mesh)
        if "1" in parts:
            part1("big state", big, contenders, args.repeats, not args.no_bare_copy)
            many = _common.many_leaf_tree(args.leaves, args.leaves_mib, mesh)
            part1("many-leaf state", many, contenders, args.repeats, not args.no_bare_copy)
            del many
        if "2" in parts and args.train_steps:
            part2(big, contenders + [PinnedAndThread(base)], args.train_steps, args.save_at, args.train_rounds)
        if "3" in parts and args.loop_rounds:
            part3(big, contenders, args.loop_rounds, args.loop_seconds)
        if "4" in parts and "zarrckpt" in names:
            part4(big, base, args.repeats)
    finally:
        for contender in contenders:
            contender.close()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
