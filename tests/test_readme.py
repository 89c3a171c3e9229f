"""Every Python block of README.md runs as written, with a tiny model standing in for the
names a block leaves undefined (`state`, `train_step`, ...) and a temporary directory
for its URLs, so the quickstart can never again fail as written."""

import re
from pathlib import Path

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax

README = Path(__file__).parent.parent / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def stand_ins() -> dict:
    """The names the README's blocks use without defining: a 2-layer model trained with optax."""
    params = {"w": jnp.full((4, 2), 0.1), "b": jnp.zeros(2)}
    optimizer = optax.adam(1e-2)

    @jax.jit
    def train_step(state, batch):
        def loss_fn(p):
            return jnp.mean((batch.astype(jnp.float32)[:, None] @ p["w"][:1] + p["b"] - 1.0) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}, loss

    state = {"params": params, "opt_state": optimizer.init(params)}
    batches = iter(grain.MapDataset.range(10**6).batch(8))
    return {"jax": jax, "np": np, "jnp": jnp, "params": params, "state": state, "target": {"params": params, "step": 0},
            "train_step": train_step, "batches": batches, "num_steps": 1000,
            "evaluate": lambda p: float(jnp.sum(p["w"]))}


def test_every_python_block_of_the_readme_runs(tmp_path):
    blocks = python_blocks()
    assert len(blocks) >= 5, "the README lost its examples"
    namespace = stand_ins()
    for number, block in enumerate(blocks, 1):
        code = (block.replace("gs://bucket/", f"{tmp_path}/").replace("/tmp/ckpt", f"{tmp_path}/ckpt")
                .replace("timeout_s=600", "timeout_s=0.2"))
        exec(compile(code, f"README.md python block {number}", "exec"), namespace)
    import zarrckpt

    assert zarrckpt.all_steps(f"{tmp_path}/run1") == [1000, 1001]  # the quickstart saved, then the functions
    assert namespace["restored"]["data"].value == {"next_index": 0}  # a fresh grain iterator's position
    assert namespace["evaluated"]["params"]["w"].shape == (4, 2)
