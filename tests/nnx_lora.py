"""A flax NNX LoRA fine-tune as users write one: GPT-width decoder blocks whose bf16
matrices are sharded by rows over a mesh's `fsdp` axis, `nnx.LoRALinear` on q and v,
an `nnx.Optimizer` over the LoRA parameters alone and an `nnx.jit` train step, which
gives every parameter back as a new array (the frozen ones with the same values).
Used by the tests (tests/test_reuse_everywhere.py, workers/mp_reuse.py) and by
benchmarks/incremental.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh


class Block(nnx.Module):
    """A decoder block of width `d`: attention with LoRA adapters of rank `rank` on q and
    v, a 4x MLP, a layer norm."""

    def __init__(self, d: int, rank: int, rngs: nnx.Rngs) -> None:
        rows = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("fsdp", None))

        def linear(n_in: int, n_out: int) -> nnx.Linear:
            return nnx.Linear(n_in, n_out, use_bias=False, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16,
                              kernel_init=rows, rngs=rngs)

        def lora(n_in: int, n_out: int) -> nnx.LoRALinear:
            return nnx.LoRALinear(n_in, n_out, lora_rank=rank, use_bias=False, param_dtype=jnp.bfloat16,
                                  dtype=jnp.bfloat16, lora_param_dtype=jnp.float32, kernel_init=rows, rngs=rngs)

        self.q, self.k, self.v, self.o = lora(d, d), linear(d, d), lora(d, d), linear(d, d)
        self.up, self.down = linear(d, 4 * d), linear(4 * d, d)
        self.norm = nnx.LayerNorm(d, rngs=rngs)

    def __call__(self, h: jax.Array) -> jax.Array:
        x = self.norm(h)
        q, k, v = self.q(x), self.k(x), self.v(x)
        attention = jax.nn.softmax((q @ k.T).astype(jnp.float32) / q.shape[-1] ** 0.5, axis=-1).astype(v.dtype)
        h = h + self.o(attention @ v)
        return h + self.down(jax.nn.gelu(self.up(h)))


def lora_fine_tune(mesh: Mesh, *, d: int = 768, blocks: int = 1, rank: int = 8):
    """The model and its optimizer, made on `mesh` (every process of a job calls it
    alike), and the train step: `step(model, optimizer, seed)` trains the adapters on a
    batch drawn from `seed`, in place."""
    @nnx.jit
    def create():
        return nnx.Sequential(*[Block(d, rank, nnx.Rngs(i)) for i in range(blocks)])

    with jax.set_mesh(mesh):
        model = create()
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.LoRAParam)

    @nnx.jit
    def step(model, optimizer, seed):
        x = jax.random.normal(jax.random.key(seed), (16, d), jnp.bfloat16)

        def loss(model):
            return jnp.mean(model(x).astype(jnp.float32) ** 2)

        grads = nnx.grad(loss, argnums=nnx.DiffState(0, nnx.LoRAParam))(model)
        optimizer.update(model, grads)

    return model, optimizer, step


def state_of(model, optimizer) -> nnx.State:
    """What a manager saves: `nnx.state((model, optimizer))`."""
    return nnx.state((model, optimizer))
