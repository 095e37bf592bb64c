"""SparseStream gradients end to end on one process: allreduce_gradients passes them through
exactly, lazy(inner) equals inner on the dense gradient for elementwise optimizers, and
apply_updates adds a stream at its support."""

import pickle

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import sparcml_jax

SIZE = 200


def _lookup_gradient(rng, pairs=40):
    ids = rng.integers(0, SIZE + 1, (4, pairs // 4)).astype(np.int32)  # SIZE marks padding
    vals = rng.integers(-3, 4, ids.shape).astype(np.float32)
    return sparcml_jax.coalesce(ids, vals, size=SIZE)


def _params(rng):
    return {"w": jnp.asarray(rng.standard_normal(SIZE).astype(np.float32)), "b": jnp.zeros(3)}


@pytest.mark.parametrize("inner", [
    lambda: optax.adagrad(0.1),
    lambda: optax.sgd(0.3),
    lambda: optax.chain(optax.clip(1.0), optax.adagrad(0.2)),
    lambda: optax.inject_hyperparams(optax.adagrad)(learning_rate=0.1),
])
def test_lazy_elementwise_optimizer_equals_it_on_the_dense_gradient(inner):
    rng = np.random.default_rng(0)
    sparse_tx = optax.chain(sparcml_jax.allreduce_gradients(), sparcml_jax.lazy(inner()))
    dense_tx = optax.chain(sparcml_jax.allreduce_gradients(), inner())
    sparse_params = dense_params = _params(rng)
    sparse_state, dense_state = sparse_tx.init(sparse_params), dense_tx.init(dense_params)

    @jax.jit
    def sparse_step(params, state, grads):
        updates, state = sparse_tx.update(grads, state, params)
        return sparcml_jax.apply_updates(params, updates), state

    for _ in range(12):
        stream = _lookup_gradient(rng)
        b = jnp.asarray(rng.standard_normal(3).astype(np.float32))
        sparse_params, sparse_state = sparse_step(sparse_params, sparse_state, {"w": stream, "b": b})
        updates, dense_state = dense_tx.update({"w": stream.to_dense(), "b": b}, dense_state, dense_params)
        dense_params = optax.apply_updates(dense_params, updates)
    for name in ("w", "b"):
        np.testing.assert_allclose(np.asarray(sparse_params[name]), np.asarray(dense_params[name]), rtol=1e-6,
                                   atol=1e-7)
    restored = pickle.loads(pickle.dumps(sparse_state))
    assert jax.tree.structure(restored) == jax.tree.structure(sparse_state)


def test_lazy_adam_keeps_untouched_moments():
    """LazyAdam semantics: coordinates outside the support keep their moments; touched ones move
    exactly as optax.adam's would on that coordinate alone."""
    rng = np.random.default_rng(1)
    params = _params(rng)
    tx = sparcml_jax.lazy(optax.adam(0.01))
    state = tx.init(params)
    first = _lookup_gradient(rng)
    updates, state = tx.update({"w": first, "b": jnp.ones(3)}, state, params)
    params = sparcml_jax.apply_updates(params, updates)
    second = sparcml_jax.coalesce(jnp.array([5, 7], jnp.int32), jnp.array([1.0, -2.0]), size=SIZE)
    mu_before = np.asarray(state[0].mu["w"])
    _, state = tx.update({"w": second, "b": jnp.ones(3)}, state, params)
    mu_after = np.asarray(state[0].mu["w"])
    untouched = np.setdiff1d(np.arange(SIZE), [5, 7])
    np.testing.assert_array_equal(mu_after[untouched], mu_before[untouched])
    np.testing.assert_allclose(mu_after[[5, 7]], 0.9 * mu_before[[5, 7]] + 0.1 * np.array([1.0, -2.0]), rtol=1e-6)
    assert int(state[0].count) == 2


def test_dense_form_stream_is_the_dense_update():
    rng = np.random.default_rng(2)
    params = _params(rng)
    g = jnp.asarray(rng.standard_normal(SIZE).astype(np.float32))
    stream = sparcml_jax.from_dense(g)
    assert int(stream.nnz) == SIZE
    tx = sparcml_jax.lazy(optax.adagrad(0.1))
    updates, _ = tx.update({"w": stream, "b": jnp.zeros(3)}, tx.init(params), params)
    want, _ = optax.adagrad(0.1).update({"w": g, "b": jnp.zeros(3)}, optax.adagrad(0.1).init(params), params)
    np.testing.assert_allclose(np.asarray(updates["w"].to_dense()), np.asarray(want["w"]), rtol=1e-6)


@pytest.mark.parametrize("min_size", [1024, 0])  # 0: the stream leaf sat in the fused buffer that init planned
def test_allreduce_gradients_passes_streams_exactly_beside_sparsified_leaves(min_size):
    """density applies to dense leaves (top-k + error feedback); stream leaves travel whole."""
    rng = np.random.default_rng(3)
    params = {"w": jnp.zeros(SIZE), "dense": jnp.zeros(2000)}
    tx = sparcml_jax.allreduce_gradients(density=0.01, min_size=min_size)
    state = tx.init(params)
    stream = _lookup_gradient(rng)
    dense = jnp.asarray(rng.standard_normal(2000).astype(np.float32))
    out, state = jax.jit(tx.update)({"w": stream, "dense": dense}, state)
    np.testing.assert_array_equal(np.asarray(out["w"].to_dense()), np.asarray(stream.to_dense()))
    assert int((out["dense"] != 0).sum()) == 20
    residual, stats = (optax.tree_utils.tree_get(state, name) for name in ("residual", "stats"))
    residual = sparcml_jax.unfuse_leaves(residual, params, min_size=min_size)
    np.testing.assert_array_equal(np.asarray(residual["w"]), np.zeros(SIZE))
    np.testing.assert_allclose(np.asarray(residual["dense"] + out["dense"]), np.asarray(dense))
    assert float(stats.density) == pytest.approx((int(stream.nnz) + 20) / (SIZE + 2000))


def test_a_leaf_that_comes_as_a_stream_keeps_its_residual_for_when_it_comes_back_dense():
    """The residual lives on the fused buffer that init planned; a step whose gradient brings a
    leaf of that buffer as a stream updates the other leaves' segments and keeps that leaf's."""
    rng = np.random.default_rng(8)
    params = {"w": jnp.zeros(SIZE), "dense": jnp.zeros(2000)}
    tx = sparcml_jax.allreduce_gradients(k=10, min_size=0)
    update = jax.jit(tx.update)
    state = tx.init(params)
    as_dense = lambda: {"w": jnp.asarray(rng.integers(-4, 5, SIZE).astype(np.float32)),  # noqa: E731
                        "dense": jnp.asarray(rng.integers(-4, 5, 2000).astype(np.float32))}
    steps = [as_dense(), {"w": _lookup_gradient(rng), "dense": as_dense()["dense"]}, as_dense()]
    total_grads = jax.tree.map(jnp.zeros_like, params)
    total_sent = jax.tree.map(jnp.zeros_like, params)
    held = []
    for grads in steps:
        sent, state = update(grads, state, params)
        held.append(sparcml_jax.unfuse_leaves(optax.tree_utils.tree_get(state, "residual"), params, min_size=0))
        dense = {name: g.to_dense() if isinstance(g, sparcml_jax.SparseStream) else g for name, g in grads.items()}
        total_grads = jax.tree.map(jnp.add, total_grads, dense)
        total_sent = jax.tree.map(jnp.add, total_sent, {name: x.to_dense() if isinstance(x, sparcml_jax.SparseStream)
                                                        else x for name, x in sent.items()})
    assert np.abs(np.asarray(held[0]["w"])).max() > 0  # something of "w" was held back at the first step
    np.testing.assert_array_equal(np.asarray(held[1]["w"]), np.asarray(held[0]["w"]))  # and kept over the stream step
    for name in params:
        np.testing.assert_array_equal(np.asarray(total_sent[name] + held[-1][name]), np.asarray(total_grads[name]))


def test_stream_leaf_errors():
    rng = np.random.default_rng(4)
    params = {"w": jnp.zeros(SIZE)}
    with pytest.raises(ValueError, match="not supported with buckets"):
        tx = sparcml_jax.allreduce_gradients(density=0.1, buckets=2)
        tx.update({"w": _lookup_gradient(rng)}, tx.init(params))
    with pytest.raises(ValueError, match=r"gradient leaf 0 has a SparseStream of size 50 but its parameter has "
                                         r"shape \(200,\)"):
        tx = sparcml_jax.allreduce_gradients(density=0.1)
        tx.update({"w": sparcml_jax.coalesce(jnp.array([1], jnp.int32), jnp.ones(1), size=50)}, tx.init(params),
                  params)
    with pytest.raises(ValueError, match="the stream must index the flattened parameter"):
        sparcml_jax.apply_updates({"w": jnp.zeros((3, 3))}, {"w": _lookup_gradient(rng)})


def test_apply_updates_in_place_under_donation():
    rng = np.random.default_rng(5)
    params = {"w": jnp.ones((10, 20)), "b": jnp.ones(2)}
    stream = sparcml_jax.coalesce(jnp.array([0, 199, 0], jnp.int32), jnp.array([1.0, 2.0, 3.0]), size=200)
    step = jax.jit(sparcml_jax.apply_updates, donate_argnums=0)
    out = step(params, {"w": stream, "b": jnp.asarray(rng.standard_normal(2).astype(np.float32))})
    w = np.ones((10, 20), np.float32)
    w[0, 0], w[9, 19] = 5.0, 3.0
    np.testing.assert_array_equal(np.asarray(out["w"]), w)
