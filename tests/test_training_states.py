"""Training states as people build them round-trip: optax optimizer states (namedtuples,
empty states, masked and injected-hyperparameter states), a dataclass train state
registered with jax.tree_util.register_dataclass, and PRNG keys, typed and raw.
(flax.struct dataclasses are registered pytree dataclasses too; flax itself is not a
test dependency.)"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import zarrckpt

OPTIMIZERS = {
    # A tuple of states: EmptyState from clipping, ScaleByAdamState (count, mu, nu), more EmptyStates.
    "clip+adamw": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)),
    # MaskedState, whose inner state holds MaskedNode() (an empty namedtuple) for masked-out leaves.
    "masked sgd": lambda: optax.masked(optax.sgd(0.1, momentum=0.9),
                                       {"dense": {"kernel": True, "bias": False}, "scale": False}),
    # InjectHyperparamsState: a dict of hyperparameters beside the inner state.
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-3),
    # A schedule adds ScaleByScheduleState (a step count).
    "adam+schedule": lambda: optax.adam(optax.linear_schedule(1e-2, 0.0, 100)),
}


def init_params() -> dict:
    return {"dense": {"kernel": jnp.arange(32.0).reshape(8, 4) / 10, "bias": jnp.zeros(4)}, "scale": jnp.ones(())}


def grads_of(params: dict) -> dict:
    return jax.tree_util.tree_map(lambda p: jnp.full_like(p, 0.5), params)


def assert_same_tree(got: Any, expected: Any) -> None:
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(expected)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves(expected)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_optax_state_round_trips(tmp_path, name):
    optimizer = OPTIMIZERS[name]()
    params = init_params()
    opt_state = optimizer.init(params)
    for _ in range(2):  # a state that is not all zeros
        updates, opt_state = optimizer.update(grads_of(params), opt_state, params)
        params = optax.apply_updates(params, updates)
    url = str(tmp_path / "c")
    zarrckpt.save_pytree(url, {"params": params, "opt_state": opt_state})

    fresh = init_params()
    back = zarrckpt.load_pytree(url, {"params": fresh, "opt_state": optimizer.init(fresh)})
    assert_same_tree(back, {"params": params, "opt_state": opt_state})
    # Training goes on exactly as it would have.
    expected, _ = optimizer.update(grads_of(params), opt_state, params)
    resumed, _ = optimizer.update(grads_of(back["params"]), back["opt_state"], back["params"])
    assert_same_tree(resumed, expected)


def test_optax_state_without_target_is_nested_dicts(tmp_path):
    optimizer = OPTIMIZERS["clip+adamw"]()
    params = init_params()
    _, opt_state = optimizer.update(grads_of(params), optimizer.init(params), params)
    url = str(tmp_path / "c")
    zarrckpt.save_pytree(url, opt_state)
    plain = zarrckpt.load_pytree(url)
    # A reader never imports optax: namedtuples come back as dicts keyed by field name.
    adam = plain[1][0]
    assert isinstance(adam, dict) and set(adam) == {"count", "mu", "nu"}
    np.testing.assert_array_equal(adam["mu"]["dense"]["kernel"], np.asarray(opt_state[1][0].mu["dense"]["kernel"]))
    assert plain[0] == {}  # EmptyState


@functools.partial(jax.tree_util.register_dataclass, data_fields=["step", "params", "opt_state", "rng", "dropout_rng"],
                   meta_fields=["model_name"])
@dataclasses.dataclass(frozen=True)
class TrainState:
    step: jax.Array
    params: dict
    opt_state: Any
    rng: jax.Array  # a typed key array: jax.random.key
    dropout_rng: jax.Array  # a raw uint32 key: jax.random.PRNGKey
    model_name: str  # static: part of the tree structure, not saved as a leaf


def make_train_state(mesh: Mesh, seed: int) -> TrainState:
    params = jax.device_put(init_params(), {"dense": {"kernel": NamedSharding(mesh, P(None, "x")),
                                                      "bias": NamedSharding(mesh, P("x"))},
                                            "scale": NamedSharding(mesh, P())})
    return TrainState(step=jnp.array(seed, jnp.int32), params=params, opt_state=optax.adam(1e-3).init(params),
                      rng=jax.random.key(seed), dropout_rng=jax.random.PRNGKey(seed + 1), model_name="mlp")


def test_dataclass_train_state_round_trips_onto_another_mesh(tmp_path):
    devices = np.array(jax.devices())
    saved = make_train_state(Mesh(devices[:4], ("x",)), seed=5)
    url = str(tmp_path / "c")
    zarrckpt.save_pytree(url, saved)

    target = make_train_state(Mesh(devices[:2], ("x",)), seed=0)
    back = zarrckpt.load_pytree(url, target, donate_target=False)
    assert isinstance(back, TrainState) and back.model_name == "mlp"
    assert back.params["dense"]["kernel"].sharding == target.params["dense"]["kernel"].sharding
    np.testing.assert_array_equal(jax.random.key_data(back.rng), jax.random.key_data(saved.rng))
    assert int(back.step) == 5
    for restored, original in ((back.params, saved.params), (back.opt_state, saved.opt_state),
                               (back.dropout_rng, saved.dropout_rng)):
        assert_same_tree(restored, original)
    # The keys draw the same numbers as before the save.
    assert jax.dtypes.issubdtype(back.rng.dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(jax.random.normal(back.rng, (3,)), jax.random.normal(saved.rng, (3,)))
    np.testing.assert_array_equal(jax.random.normal(back.dropout_rng, (3,)),
                                  jax.random.normal(saved.dropout_rng, (3,)))

    plain = zarrckpt.load_pytree(url)
    assert set(plain) == {"step", "params", "opt_state", "rng", "dropout_rng"}
    assert jax.dtypes.issubdtype(plain["rng"].dtype, jax.dtypes.prng_key)
    assert plain["dropout_rng"].dtype == np.uint32


def test_python_scalars_restore_into_abstract_targets_from_eval_shape(tmp_path):
    """flax's TrainState.create sets step=0 and optax's inject_hyperparams holds Python
    floats: saved as int64/float64, they restore into the int32/float32 target that
    `jax.eval_shape` makes of them, when the value fits (an int exactly; a float rounded
    as JAX rounds it, never to infinity or zero)."""
    from flax.training import train_state

    tx = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)
    state = train_state.TrainState.create(apply_fn=None, params=init_params(), tx=tx)
    saved = {"step": state.step, "params": state.params, "opt_state": state.opt_state, "lr": 3e-4, "epoch": 7}
    assert isinstance(saved["step"], int)
    zarrckpt.save_pytree(str(tmp_path / "a"), saved)
    abstract = jax.eval_shape(lambda: saved)
    assert abstract["step"].dtype == jnp.int32 and abstract["lr"].dtype == jnp.float32
    restored = zarrckpt.load_pytree(str(tmp_path / "a"), abstract)
    assert restored["step"].dtype == jnp.int32 and int(restored["step"]) == 0 and int(restored["epoch"]) == 7
    assert restored["lr"].dtype == jnp.float32 and float(restored["lr"]) == np.float32(3e-4)

    zarrckpt.save_pytree(str(tmp_path / "b"), {"step": 2**40, "lr": 1e300, "tiny": 1e-300})
    with pytest.raises(zarrckpt.CheckpointMismatchError) as raised:
        zarrckpt.load_pytree(str(tmp_path / "b"), jax.eval_shape(lambda: {"step": 0, "lr": 0.0, "tiny": 0.0}))
    message = str(raised.value)
    assert "['step']: saved Python int 1099511627776 is not representable as int32" in message
    assert "['lr']: saved Python float 1e+300 is not representable as float32" in message
    assert "['tiny']: saved Python float 1e-300 is not representable as float32" in message
    with pytest.raises(zarrckpt.CheckpointMismatchError, match="dtype int64 in the checkpoint, float32"):
        zarrckpt.load_pytree(str(tmp_path / "b"), {"step": jax.ShapeDtypeStruct((), jnp.float32), "lr": 0.0,
                                                  "tiny": 0.0})


def test_a_state_fresh_from_optax_init_restores_and_trains_on_a_mesh_at_once(tmp_path):
    """`adam.init` makes `count` (and `jax.random.key` a key) without a placement: they
    come back so, and the jitted step meeting them beside sharded arrays runs."""
    mesh = Mesh(np.array(jax.devices()), ("x",))
    opt = optax.adam(1e-2)

    def fresh(seed):
        params = {"w": jax.device_put(jnp.full((16, 4), float(seed)), NamedSharding(mesh, P("x")))}
        return {"params": params, "opt_state": opt.init(params), "rng": jax.random.key(seed)}

    @jax.jit
    def step(state):
        grads = jax.tree.map(jnp.ones_like, state["params"])
        updates, opt_state = opt.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state,
                "rng": jax.random.split(state["rng"])[0]}

    saved = step(step(fresh(1)))
    with zarrckpt.CheckpointManager(str(tmp_path / "run")) as mgr:
        mgr.save(2, saved)
    target = fresh(0)
    assert not target["opt_state"][0].count.committed and not target["rng"].committed
    with zarrckpt.CheckpointManager(str(tmp_path / "run")) as mgr:
        restored, at = mgr.restore(target)
    assert at == 2
    assert not restored["opt_state"][0].count.committed and not restored["rng"].committed
    assert restored["params"]["w"].sharding == target["params"]["w"].sharding
    for got, want in zip(jax.tree.leaves(step(restored)), jax.tree.leaves(step(saved))):
        if jax.dtypes.issubdtype(want.dtype, jax.dtypes.prng_key):
            got, want = jax.random.key_data(got), jax.random.key_data(want)
        assert np.array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("readers_place", [False, True], ids=["main thread", "reader threads"])
def test_a_state_from_jitted_optax_init_restores_its_large_leaves_uncommitted_and_trains(tmp_path, monkeypatch,
                                                                                       readers_place):
    """`jax.jit(tx.init)(params)` makes mu and nu uncommitted arrays on one device, of any
    size: every one comes back uncommitted (a committed leaf committed where it was), so
    the jitted step meeting them beside arrays sharded over a mesh runs."""
    from zarrckpt._restore import match as _match

    if readers_place:  # the reader threads place a leaf of 2 MiB, as large ones on a GPU
        monkeypatch.setattr(_match, "_CPU_READER_PLACEMENT_BYTES", 2**20)
    mesh = Mesh(np.array(jax.devices()), ("x",))
    tx = optax.adam(1e-2)
    params = {"big": jax.device_put(jnp.ones((512, 1024)), NamedSharding(mesh, P("x"))),  # 2 MiB
              "small": jax.device_put(jnp.ones((16, 4)), NamedSharding(mesh, P("x")))}
    pinned = jax.device_put(jnp.arange(3.0), jax.devices()[3])

    @jax.jit
    def step(params, opt_state):
        updates, opt_state = tx.update(jax.tree.map(jnp.ones_like, params), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    state = {"params": params, "opt_state": jax.jit(tx.init)(params), "pinned": pinned}
    assert not state["opt_state"][0].mu["big"].committed
    zarrckpt.save_pytree(str(tmp_path / "c"), state)
    restored = zarrckpt.load_pytree(str(tmp_path / "c"), state)
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(restored), jax.tree.leaves(state)):
        assert got.committed == want.committed and got.sharding == want.sharding, jax.tree_util.keystr(path)
    assert_same_tree(step(restored["params"], restored["opt_state"]), step(params, state["opt_state"]))
