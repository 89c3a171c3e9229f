"""A tiny plain-JAX training loop that checkpoints with zarrckpt and resumes where it left off.

    python examples/train_minimal.py     # trains 30 steps, saving every 10
    python examples/train_minimal.py     # run again: resumes at step 30, trains to step 60

Saves are asynchronous: `mgr.save` returns once the copies of the state to host memory
are dispatched, so the next (buffer-donating) training step can run while the
checkpoint is written. A SIGTERM (what a scheduler sends before it preempts a job)
makes the manager save the step it is at, and the loop stop there.

The state (parameters, optimizer moments, step, RNG key) is sharded over the host's
devices; on a CPU-only machine the example asks XLA for 8 fake devices.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import zarrckpt  # noqa: E402


def init_state(key: jax.Array, mesh: Mesh) -> dict:
    k1, k2, k3 = jax.random.split(key, 3)
    params = {
        "hidden": {"w": jax.random.normal(k1, (16, 64)) * 0.1, "b": jnp.zeros(64)},
        "out": {"w": jax.random.normal(k2, (64, 1)) * 0.1, "b": jnp.zeros(1)},
    }
    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    state = {"params": params, "momentum": zeros, "step": jnp.array(0, jnp.int32), "rng": k3}
    return jax.device_put(state, shardings(state, mesh))


def shardings(state: dict, mesh: Mesh) -> dict:
    """Weight matrices split over the 'model' axis, everything else replicated."""
    def spec(x):
        return NamedSharding(mesh, P(None, "model") if x.ndim == 2 and x.shape[1] % mesh.shape["model"] == 0
                             else P())
    return jax.tree_util.tree_map(spec, state)


def loss_fn(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    h = jax.nn.relu(x @ params["hidden"]["w"] + params["hidden"]["b"])
    return jnp.mean((h @ params["out"]["w"] + params["out"]["b"] - y) ** 2)


def train_step(state: dict) -> tuple[dict, jax.Array]:
    rng, data_key = jax.random.split(state["rng"])
    x = jax.random.normal(data_key, (128, 16))
    y = jnp.sin(x.sum(axis=1, keepdims=True))
    loss, grads = jax.value_and_grad(loss_fn)(state["params"], x, y)
    momentum = jax.tree_util.tree_map(lambda m, g: 0.9 * m + g, state["momentum"], grads)
    params = jax.tree_util.tree_map(lambda p, m: p - 0.05 * m, state["params"], momentum)
    return {"params": params, "momentum": momentum, "step": state["step"] + 1, "rng": rng}, loss


def train(url: str, steps: int, save_every: int, *, keep_last: int = 3,
          storage_options: dict | None = None) -> int:
    """Trains `steps` steps from the newest committed step (or from scratch); returns
    the last step."""
    mesh = Mesh(np.array(jax.devices()).reshape(-1, 2 if len(jax.devices()) % 2 == 0 else 1), ("data", "model"))
    # The template fixes structure, shapes, dtypes and shardings; its values are replaced on resume.
    template = init_state(jax.random.PRNGKey(0), mesh)
    # The state keeps its shardings from step to step (else XLA picks the outputs' own,
    # and the second step compiles again), and each step's input buffers are reused.
    step_fn = jax.jit(train_step, donate_argnums=0, out_shardings=(shardings(template, mesh), None))
    with zarrckpt.CheckpointManager(url, save_interval_steps=save_every, keep_last=keep_last,
                                    storage_options=storage_options) as mgr:
        state, step = mgr.restore(template)
        last = step + steps
        print(f"resumed from step {step}: training to step {last}" if mgr.restored_step is not None
              else f"no checkpoint yet: starting from scratch, training to step {last}", flush=True)
        while step < last:
            state, loss = step_fn(state)
            step += 1
            if mgr.save(step, state):
                print(f"step {step}: loss {float(loss):.4f}, saving to {url}", flush=True)
            if mgr.reached_preemption(step):  # a SIGTERM came: this step is saved; stop here
                print(f"preempted: step {step} saved, stopping", flush=True)
                break
    # Leaving the `with` block waited for the last save to commit.
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint-dir", default="checkpoints/train_minimal", help="local path or fsspec URL")
    parser.add_argument("--steps", type=int, default=30, help="steps to train in this run")
    parser.add_argument("--save-every", type=int, default=10)
    args = parser.parse_args()
    step = train(args.checkpoint_dir, args.steps, args.save_every)
    print(f"done at step {step}; committed steps: {zarrckpt.all_steps(args.checkpoint_dir)}", flush=True)


if __name__ == "__main__":
    main()
