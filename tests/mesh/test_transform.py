"""allreduce_gradients over a mesh axis (``axis_name=``) in a jitted ``jax.shard_map`` train
step: every device applies the same update, and the books balance (the update is the mean of
what the devices took from gradient plus residual), for SparCML's algorithms and the global
top-k ones. Spawned by tests/test_mesh_spawn.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import sparcml_jax as sj

AXIS = "data"
tree_get = optax.tree_utils.tree_get


def _params():
    return {"w": jnp.zeros((30, 40)), "b": jnp.zeros(40), "v": jnp.zeros(3000)}


def _grads(p: int, step: int):
    rng = np.random.default_rng([step, p])
    return jax.tree.map(lambda x: rng.integers(-4, 5, (p, *x.shape)).astype(np.float32), _params())


def _flat(tree, device=None):
    leaves = jax.tree.leaves(tree)
    return np.concatenate([np.asarray(x if device is None else x[device]).ravel() for x in leaves])


def _residual(state, options: dict):
    """The residual per parameter leaf (kept as one vector per fused buffer)."""
    return sj.unfuse_leaves(tree_get(state, "residual"), _params(), min_size=options.get("min_size", 1024),
                            fuse=options.get("fuse", True))


def _steps(p: int, tx: optax.GradientTransformation, steps: int, options: dict):
    """(updates, residuals before, residuals after) of every step, stacked by device."""
    mesh = jax.make_mesh((p,), (AXIS,), devices=jax.devices()[:p])
    stacked = lambda t: jax.tree.map(lambda x: x[None], t)  # noqa: E731

    def train(*grads):
        state, out = tx.init(_params()), []
        for g in grads:
            g = jax.tree.map(lambda x: x[0], g)
            before = _residual(state, options)
            updates, state = tx.update(g, state, _params())
            out.append((stacked(updates), stacked(before), stacked(_residual(state, options))))
        return out

    run = jax.jit(jax.shard_map(train, mesh=mesh, in_specs=(P(AXIS),) * steps, out_specs=P(AXIS)))
    grads = [jax.device_put(_grads(p, t), NamedSharding(mesh, P(AXIS))) for t in range(steps)]
    return jax.tree.map(np.asarray, run(*grads)), [_grads(p, t) for t in range(steps)]


@pytest.mark.parametrize("p", (1, 3, 4))
@pytest.mark.parametrize("options", [dict(algorithm="ssar_split_allgather", density=0.02, min_size=100),
                                     dict(algorithm="dsar_split_allgather", k=50, fuse=False),
                                     dict(algorithm="spardl", density=0.02, min_size=100),
                                     dict(algorithm="gtopk", k=60, warmup_steps=1),
                                     dict(algorithm="oktopk", density=0.02, min_size=100, tau=2, tau_prime=2)],
                         ids=lambda o: o["algorithm"])
def test_every_device_applies_the_update_the_books_say(options, p):
    tx = sj.allreduce_gradients(axis_name=AXIS, **options)
    results, grads = _steps(p, tx, 3, options)
    for t, (updates, before, after) in enumerate(results):
        label = f"{options['algorithm']} P={p} step {t}"
        mine = [_flat(updates, d) for d in range(p)]
        assert all(np.array_equal(m, mine[0]) for m in mine), f"{label}: devices differ"
        taken = sum(_flat(grads[t], d) + _flat(before, d) - _flat(after, d) for d in range(p))
        np.testing.assert_allclose(mine[0], taken / p, rtol=2e-7, atol=0, err_msg=label)


@pytest.mark.parametrize("p", (2, 5))
def test_dense_baseline_is_pmean(p):
    mesh = jax.make_mesh((p,), (AXIS,), devices=jax.devices()[:p])
    tx = sj.dense_allreduce_gradients(axis_name=AXIS)

    def both(g):
        g = jax.tree.map(lambda x: x[0], g)
        ours, _ = tx.update(g, tx.init(_params()))
        return jax.tree.map(lambda a, b: jnp.stack([a, b])[None], ours, jax.lax.pmean(g, AXIS))

    out = jax.jit(jax.shard_map(both, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))(
        jax.device_put(_grads(p, 0), NamedSharding(mesh, P(AXIS))))
    for leaf in jax.tree.leaves(out):
        np.testing.assert_array_equal(np.asarray(leaf)[:, 0], np.asarray(leaf)[:, 1])


def test_mesh_arguments_are_checked_where_the_transform_is_built():
    with pytest.raises(ValueError, match="comm and axis_name are exclusive"):
        sj.allreduce_gradients(density=0.01, axis_name=AXIS, comm=object())
    with pytest.raises(ValueError, match="transport='mpi4jax' is an MPI transport"):
        sj.allreduce_gradients(density=0.01, axis_name=AXIS, transport="mpi4jax")
    with pytest.raises(ValueError, match="buckets run on the non-blocking engine"):
        sj.allreduce_gradients(density=0.01, axis_name=AXIS, buckets=2)


def test_unordered_collective_refuses_a_program_over_several_devices():
    """With ``ordered=False`` over MPI, a jitted update on a sharded gradient would make one MPI
    call per device, unordered: lowering raises, as JAX does for the ordered effect."""
    mesh = jax.make_mesh((2,), (AXIS,))
    params = {"w": jax.device_put(jnp.zeros((64, 64)), NamedSharding(mesh, P(AXIS)))}
    tx = sj.allreduce_gradients(density=0.1, ordered=False)
    with pytest.raises(ValueError, match="in a program over several devices would run once per device"):
        jax.jit(tx.update)(params, tx.init(params))
