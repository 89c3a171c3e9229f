"""Training loops written the way flax NNX, equinox and plain jax + grain document them,
checkpointed with zarrckpt.CheckpointManager (tests/test_user_workflows.py).

One process, one loop (or several, one after the other, each from its own
CKPT_DIR to its own STOP_AT, written to its own OUT.npz):

    python user_loops.py LOOP CKPT_DIR STOP_AT TOTAL OUT.npz [CKPT_DIR STOP_AT OUT.npz]...

trains LOOP (nnx, equinox or grain) from the newest step committed under CKPT_DIR (or
from scratch) up to step STOP_AT (at most TOTAL), then writes to OUT.npz the final
parameters (`param/<key path>`), the loss of each step it ran (`loss/<step>`), the
data batches it consumed (`batch/<step>/x` and `batch/<step>/y`, the grain loop only),
the step it resumed from (`resumed_from`, 0 for a fresh start), the steps its saves
committed (`saved`) and the steps left in CKPT_DIR at the end (`committed`). A broken
expectation inside the loop (a restore that freed the caller's arrays, a step counter
that disagrees with the restored step) exits non-zero with an AssertionError.

Two processes of one jax.distributed job (launched by tests/multiprocess.py):

    python user_loops.py COORDINATOR 2 PID shards CKPT_DIR

each process reads its own shard of a grain dataset, saves its iterator's position as
a zarrckpt.PerProcess leaf with save_checkpoint, restores it, and reports both.
"""

from __future__ import annotations

import sys

import numpy as np

LOOPS = ("nnx", "equinox", "grain")

# The regression problem every loop learns: y = sum(sin(x)) + noise, x in R^4.
FEATURES, HIDDEN, EXAMPLES, BATCH = 4, 16, 64, 8
_rng = np.random.default_rng(0)
X = _rng.normal(size=(EXAMPLES, FEATURES)).astype(np.float32)
Y = (np.sin(X).sum(axis=1, keepdims=True) + 0.1 * _rng.normal(size=(EXAMPLES, 1))).astype(np.float32)


def batch_for(step: int) -> tuple[np.ndarray, np.ndarray]:
    """The batch of `step` in the loops without a data loader: a function of the step
    alone, as a resumed run needs."""
    idx = np.random.default_rng(step).choice(EXAMPLES, BATCH, replace=False)
    return X[idx], Y[idx]


def flat(tree, prefix: str) -> dict[str, np.ndarray]:
    import jax

    return {prefix + jax.tree_util.keystr(path): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


# -- flax NNX + optax -----------------------------------------------------------------


def nnx_loop(ckpt_dir: str, stop_at: int) -> dict:
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import zarrckpt

    class MLP(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.linear1 = nnx.Linear(FEATURES, HIDDEN, rngs=rngs)
            self.linear2 = nnx.Linear(HIDDEN, 1, rngs=rngs)

        def __call__(self, x):
            return self.linear2(nnx.relu(self.linear1(x)))

    def create():
        model = MLP(nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, x, y):
        def loss_fn(model):
            return jnp.mean((model(x) - y) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    model, optimizer = create()
    out, saved = {}, []
    with zarrckpt.CheckpointManager(ckpt_dir, keep_last=2) as mgr:
        abstract_state = nnx.state(nnx.eval_shape(create))
        restored, start = mgr.restore(abstract_state)  # (abstract_state, 0) before any save
        if start:
            nnx.update((model, optimizer), restored)
        if int(optimizer.step[...]) != start:
            raise AssertionError(f"restored step {start}, but the optimizer's step counter says "
                                 f"{int(optimizer.step[...])}")
        for step in range(start + 1, stop_at + 1):
            loss = train_step(model, optimizer, *batch_for(step))
            out[f"loss/{step}"] = np.asarray(loss)
            if mgr.save(step, nnx.state((model, optimizer)), metrics={"loss": loss}):
                saved.append(step)
    return {**out, **flat(nnx.state(model, nnx.Param), "param/"), "resumed_from": start, "saved": saved,
            "committed": zarrckpt.all_steps(ckpt_dir)}


# -- equinox + optax --------------------------------------------------------------------


def equinox_loop(ckpt_dir: str, stop_at: int) -> dict:
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    import zarrckpt

    model = eqx.nn.MLP(FEATURES, 1, width_size=HIDDEN, depth=1, key=jax.random.key(0))
    optim = optax.adam(1e-2)
    opt_state = optim.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit
    def train_step(model, opt_state, x, y):
        def loss_fn(model):
            return jnp.mean((jax.vmap(model)(x) - y) ** 2)

        loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
        updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        model = eqx.apply_updates(model, updates)
        return model, opt_state, loss

    out, saved = {}, []
    with zarrckpt.CheckpointManager(ckpt_dir, save_interval_steps=2) as mgr:
        params, static = eqx.partition(model, eqx.is_array)
        target = {"model": eqx.filter(model, eqx.is_array), "opt_state": opt_state, "step": 0}
        restored, start = mgr.restore(target)
        # The target's arrays are the model's own: restoring without donate_target
        # must leave the model that was built usable.
        if any(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(params)):
            raise AssertionError("restore freed the target's arrays (only donate_target=True may)")
        jax.block_until_ready(jax.vmap(model)(X))
        model, opt_state = eqx.combine(restored["model"], static), restored["opt_state"]
        if restored["step"] != start:
            raise AssertionError(f"restored step {start}, but the state's step counter says {restored['step']}")
        for step in range(start + 1, stop_at + 1):
            model, opt_state, loss = train_step(model, opt_state, *batch_for(step))
            out[f"loss/{step}"] = np.asarray(loss)
            state = {"model": eqx.filter(model, eqx.is_array), "opt_state": opt_state, "step": step}
            if mgr.save(step, state, metrics={"loss": loss}):
                saved.append(step)
    return {**out, **flat(eqx.filter(model, eqx.is_array), "param/"), "resumed_from": start, "saved": saved,
            "committed": zarrckpt.all_steps(ckpt_dir)}


# -- plain jax + optax, data from grain -------------------------------------------------


def grain_dataset():
    import grain

    return (grain.MapDataset.range(EXAMPLES)
            .shuffle(seed=42)
            .map(lambda i: {"x": X[i], "y": Y[i]})
            .batch(BATCH))


def grain_loop(ckpt_dir: str, stop_at: int) -> dict:
    import jax
    import jax.numpy as jnp
    import optax

    import zarrckpt

    key1, key2 = jax.random.split(jax.random.key(0))
    params = {
        "w1": jax.random.normal(key1, (FEATURES, HIDDEN)) / np.sqrt(FEATURES),
        "b1": jnp.zeros(HIDDEN),
        "w2": jax.random.normal(key2, (HIDDEN, 1)) / np.sqrt(HIDDEN),
        "b2": jnp.zeros(1),
    }
    optimizer = optax.adamw(1e-2)
    opt_state = optimizer.init(params)

    def loss_fn(params, x, y):
        hidden = jax.nn.relu(x @ params["w1"] + params["b1"])
        return jnp.mean((hidden @ params["w2"] + params["b2"] - y) ** 2)

    @jax.jit
    def train_step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    it = iter(grain_dataset())
    out, saved = {}, []
    with zarrckpt.CheckpointManager(ckpt_dir, save_interval_steps=2, keep_last=2) as mgr:
        target = {"params": params, "opt_state": opt_state, "step": 0, "data": zarrckpt.PerProcess(None)}
        restored, start = mgr.restore(target)
        params, opt_state = restored["params"], restored["opt_state"]
        if start:
            it.set_state(restored["data"].value)
        if restored["step"] != start:
            raise AssertionError(f"restored step {start}, but the state's step counter says {restored['step']}")
        for step in range(start + 1, stop_at + 1):
            batch = next(it)
            out[f"batch/{step}/x"], out[f"batch/{step}/y"] = batch["x"], batch["y"]
            params, opt_state, loss = train_step(params, opt_state, batch["x"], batch["y"])
            out[f"loss/{step}"] = np.asarray(loss)
            state = {"params": params, "opt_state": opt_state, "step": step,
                     "data": zarrckpt.PerProcess(it.get_state())}
            if mgr.save(step, state, metrics={"loss": loss}):
                saved.append(step)
    return {**out, **flat(params, "param/"), "resumed_from": start, "saved": saved,
            "committed": zarrckpt.all_steps(ckpt_dir)}


# -- two processes, one grain shard each --------------------------------------------------


def shards(ckpt_dir: str) -> None:
    import grain
    import jax
    from common import report
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import zarrckpt

    me, count = jax.process_index(), jax.process_count()
    ds = grain.MapDataset.range(EXAMPLES)[me::count].shuffle(seed=7).map(lambda i: X[i]).batch(4)
    it = iter(ds)
    for _ in range(2 + me):  # the processes stand at different positions
        next(it)
    saved_state = it.get_state()
    expected_next = next(it)

    mesh = Mesh(np.array(jax.devices()), ("data",))
    sharding = NamedSharding(mesh, P("data"))
    w_host = np.arange(2.0 * len(jax.devices()), dtype=np.float32)
    w = jax.make_array_from_callback(w_host.shape, sharding, lambda index: w_host[index])

    zarrckpt.save_checkpoint(ckpt_dir, 3, {"data": zarrckpt.PerProcess(saved_state), "w": w})
    restored, step = zarrckpt.load_checkpoint_if_it_exists(
        ckpt_dir, {"data": zarrckpt.PerProcess(None), "w": sharding})

    resumed = iter(ds)
    resumed.set_state(restored["data"].value)
    w_ok = all(np.array_equal(np.asarray(s.data), w_host[s.index]) for s in restored["w"].addressable_shards)
    report(step=step, saved_state=saved_state, restored_state=restored["data"].value,
           restored_type=type(restored["data"]).__name__,
           next_batch_matches=bool(np.array_equal(next(resumed), expected_next)), w_matches=w_ok)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in LOOPS:
        loop, first_dir, first_stop, total, first_out, *more = sys.argv[1:]
        run = {"nnx": nnx_loop, "equinox": equinox_loop, "grain": grain_loop}[loop]
        for ckpt_dir, stop_at, out in [(first_dir, first_stop, first_out), *zip(more[::3], more[1::3], more[2::3])]:
            result = run(ckpt_dir, min(int(stop_at), int(total)))
            np.savez(out, **{k: np.asarray(v) for k, v in result.items()})
        return
    from common import init

    mode, *rest = init()
    {"shards": shards}[mode](*rest)


if __name__ == "__main__":
    main()
