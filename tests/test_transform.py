"""Single-process tests of the optax transformation (P = 1: the allreduce returns what was sent)."""

import pickle

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import sparcml_jax
from sparcml_jax import allreduce_gradients, sparsifiers


def params_tree():
    return {"dense": {"w": jnp.zeros((40, 30)), "b": jnp.zeros(30)}, "head": (jnp.zeros((30, 7)), jnp.zeros(7))}


def random_grads(rng, tree):
    return jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape).astype(np.float32)), tree)


@pytest.mark.parametrize("sparsifier", ["topk", "randomk", sparsifiers.threshold(0.5)])
@pytest.mark.parametrize("fuse,buckets", [(True, None), (False, None), (True, 2)])
def test_error_feedback_loses_nothing(sparsifier, fuse, buckets):
    params = params_tree()
    tx = allreduce_gradients(density=0.05, sparsifier=sparsifier, fuse=fuse, min_size=16, buckets=buckets)
    state = tx.init(params)
    update = jax.jit(tx.update)
    rng = np.random.default_rng(0)
    total_grads = jax.tree.map(jnp.zeros_like, params)
    total_sent = jax.tree.map(jnp.zeros_like, params)
    for _ in range(100):
        grads = random_grads(rng, params)
        sent, state = update(grads, state)
        total_grads = jax.tree.map(jnp.add, total_grads, grads)
        total_sent = jax.tree.map(jnp.add, total_sent, sent)
    accounted = jax.tree.map(jnp.add, total_sent, state.residual)
    for got, want in zip(jax.tree.leaves(accounted), jax.tree.leaves(total_grads)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-3)
    assert int(state.step) == 100
    assert 0 < float(state.stats.density) <= 0.06


def test_buckets_split_the_leaves_in_reverse_order():
    from sparcml_jax.transform import _buckets

    assert _buckets([3, 2, 1, 0], [10, 10, 10, 10], 2) == [[3, 2], [1, 0]]
    assert _buckets([2, 1, 0], [100, 1, 1], 2) == [[2], [1, 0]]
    assert _buckets([0], [5], 4) == [[0]]


def test_sends_the_budget_per_step():
    params = {"w": jnp.zeros(10_000)}
    tx = allreduce_gradients(k=123)
    sent, state = jax.jit(tx.update)({"w": jnp.arange(10_000.0) + 1}, tx.init(params))
    assert int((sent["w"] != 0).sum()) == 123
    np.testing.assert_array_equal(np.asarray(sent["w"][-123:]), np.arange(10_000 - 123, 10_000) + 1.0)


@pytest.mark.parametrize("buckets", [None, 3])
def test_exact_mode_on_one_rank_is_the_identity(buckets):
    params = params_tree()
    tx = allreduce_gradients(buckets=buckets, min_size=16)
    grads = random_grads(np.random.default_rng(1), params)
    grads["dense"]["w"] = grads["dense"]["w"].at[3:].set(0.0)  # naturally sparse
    out, state = jax.jit(tx.update)(grads, tx.init(params))
    for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(grads)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert all(r.size == 0 for r in jax.tree.leaves(state.residual))  # exact: nothing is ever held back


def test_exact_mode_with_capacity_falls_back_to_dense():
    params = {"w": jnp.zeros(5000)}
    tx = allreduce_gradients(capacity=10)
    grads = {"w": jnp.ones(5000)}  # 5000 nonzeros > capacity: sent dense, still exact
    out, _ = jax.jit(tx.update)(grads, tx.init(params))
    np.testing.assert_array_equal(np.asarray(out["w"]), np.ones(5000))


def test_composes_with_adam_and_inject_hyperparams():
    params = params_tree()
    tx = optax.chain(allreduce_gradients(density=0.1, quantize_bits=4),
                     optax.inject_hyperparams(optax.adam)(learning_rate=1e-2))
    state = tx.init(params)
    grads = random_grads(np.random.default_rng(2), params)
    updates, state = jax.jit(tx.update)(grads, state, params)
    assert jax.tree.structure(updates) == jax.tree.structure(params)
    injected = optax.inject_hyperparams(allreduce_gradients, static_args=("density", "min_size"))(density=0.1)
    updates, _ = jax.jit(injected.update)(grads, injected.init(params), params)
    assert jax.tree.structure(updates) == jax.tree.structure(params)


def test_checkpoint_restore_continues_bit_identically():
    params = params_tree()
    tx = optax.chain(allreduce_gradients(density=0.05, sparsifier="randomk", quantize_bits=4), optax.adam(1e-2))
    step = jax.jit(lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(*tx.update(g, s, p)))
    rng = np.random.default_rng(3)
    grads = [random_grads(rng, params) for _ in range(6)]
    p, s = params, tx.init(params)
    for g in grads[:3]:
        p, s = step(p, s, g)
    saved = pickle.dumps(jax.device_get((p, s)))
    for g in grads[3:]:
        p, s = step(p, s, g)
    p2, s2 = pickle.loads(saved)
    for g in grads[3:]:
        p2, s2 = step(p2, s2, g)
    for a, b in zip(jax.tree.leaves((p, s)), jax.tree.leaves((p2, s2))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_runs_in_one_jitted_step_with_donated_buffers():
    params = params_tree()
    tx = optax.chain(allreduce_gradients(density=0.1), optax.sgd(0.1))

    def loss(p, x):
        h = jnp.tanh(x @ p["dense"]["w"] + p["dense"]["b"])
        return jnp.mean((h @ p["head"][0] + p["head"][1]) ** 2)

    @jax.jit
    def train_step(p, s, x):
        g = jax.grad(loss)(p, x)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    donated = jax.jit(train_step.__wrapped__ if hasattr(train_step, "__wrapped__") else train_step, donate_argnums=(0, 1))
    x = jnp.ones((8, 40))
    p, s = donated(params, tx.init(params), x)
    p, s = donated(p, s, x)
    assert int(s[0].step) == 2


@pytest.mark.parametrize("buckets", [None, 1])
def test_warmup_sends_dense(buckets):
    params = {"w": jnp.zeros(4096)}
    tx = allreduce_gradients(density=0.01, warmup_steps=2, buckets=buckets)
    state = tx.init(params)
    update = jax.jit(tx.update)
    g = {"w": jnp.arange(1.0, 4097.0)}
    out, state = update(g, state)
    assert int((out["w"] != 0).sum()) == 4096 and int(state.stats.algorithm) == -1
    out, state = update(g, state)
    out, state = update(g, state)
    assert int((out["w"] != 0).sum()) == 41


@pytest.mark.parametrize("kwargs,match", [
    (dict(density=0.0), "density"), (dict(density=1.5), "density"), (dict(density=0.1, k=3), "not both"),
    (dict(k=0), "k must"), (dict(quantize_bits=3), "quantize_bits"), (dict(sparsifier="nope"), "sparsifier"),
    (dict(sparsifier="threshold"), "threshold"), (dict(algorithm="ring"), "algorithm"),
    (dict(transport="tcp"), "transport"), (dict(quantize_bits=4, algorithm="dense"), "quantize_bits"),
    (dict(density=0.1, capacity=5), "capacity"), (dict(buckets=0), "buckets"),
    (dict(buckets=2, capacity=8), "buckets"), (dict(buckets=2, transport="mpi4jax"), "buckets"),
])
def test_bad_configuration_is_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        allreduce_gradients(**kwargs)


def test_integer_leaves_are_rejected():
    tx = allreduce_gradients(density=0.1)
    with pytest.raises(TypeError, match="only floating-point"):
        tx.init({"w": jnp.zeros(3), "count": jnp.zeros(3, jnp.int32)})


def test_mismatched_pytree_is_rejected():
    tx = allreduce_gradients(density=0.1)
    state = tx.init({"w": jnp.zeros(3)})
    with pytest.raises(ValueError, match="differs from the one given to init"):
        tx.update({"v": jnp.zeros(3)}, state)
    with pytest.raises(ValueError, match="shape"):
        tx.update({"w": jnp.zeros(4)}, state)


def test_dense_baseline_transform():
    tx = sparcml_jax.dense_allreduce_gradients()
    out, _ = jax.jit(tx.update)({"w": jnp.arange(3.0)}, tx.init({"w": jnp.zeros(3)}))
    np.testing.assert_array_equal(np.asarray(out["w"]), [0.0, 1.0, 2.0])
