"""Single-process tests of the optax transformation (P = 1: the allreduce returns what was sent)."""

import pickle
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import sparcml_jax
from sparcml_jax import allreduce_gradients, sparsifiers

tree_get = optax.tree_utils.tree_get


def params_tree():
    return {"dense": {"w": jnp.zeros((40, 30)), "b": jnp.zeros(30)}, "head": (jnp.zeros((30, 7)), jnp.zeros(7))}


def random_grads(rng, tree):
    return jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape).astype(np.float32)), tree)


def integer_grads(rng, tree):
    """Small integers: every float32 sum of them below 2**24 is exact, so invariants hold exactly."""
    return jax.tree.map(lambda p: jnp.asarray(rng.integers(-4, 5, p.shape).astype(np.float32)), tree)


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
        grads = integer_grads(rng, params)
        sent, state = update(grads, state)
        total_grads = jax.tree.map(jnp.add, total_grads, grads)
        total_sent = jax.tree.map(jnp.add, total_sent, sent)
    residual = tree_get(state, "residual")
    large = [p for p in jax.tree.leaves(params) if p.size >= 16]
    assert len(residual.buffers) == (1 if fuse and buckets is None else buckets or len(large))  # one per fused buffer
    accounted = jax.tree.map(jnp.add, total_sent, sparcml_jax.unfuse_leaves(residual, params, min_size=16, fuse=fuse,
                                                                            buckets=buckets))
    for got, want in zip(jax.tree.leaves(accounted), jax.tree.leaves(total_grads)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert 0 < float(tree_get(state, "stats").density) <= 0.06


def test_plan_groups_leaves_by_size_and_kind():
    from sparcml_jax import LeafPlan, plan_leaves

    dense = [False] * 4
    assert plan_leaves([10, 10, 10, 10], dense, min_size=5, buckets=2).groups == ((3, 2), (1, 0))
    assert plan_leaves([1, 1, 100], [False] * 3, min_size=1, buckets=2).groups == ((2,), (1, 0))
    assert plan_leaves([5], [False], min_size=1, buckets=4).groups == ((0,),)
    assert plan_leaves([3, 2000, 5000, 7], [False, False, True, False]) == LeafPlan((0, 3), ((1,),), (2,))
    assert plan_leaves([3000, 2000], dense[:2], fuse=False) == LeafPlan((), ((0,), (1,)), ())
    assert plan_leaves([3000, 2000], dense[:2], min_size=0) == LeafPlan((), ((0, 1),), ())


def test_sends_the_budget_per_step():
    params = {"w": jnp.zeros(10_000)}
    tx = allreduce_gradients(k=123)
    sent, state = jax.jit(tx.update)({"w": jnp.arange(10_000.0) + 1}, tx.init(params))
    assert int((sent["w"] != 0).sum()) == 123
    np.testing.assert_array_equal(np.asarray(sent["w"][-123:]), np.arange(10_000 - 123, 10_000) + 1.0)


def test_k_is_shared_among_the_dense_leaves_only():
    """With fuse=False the dense leaves share k in proportion to their sizes; a stream leaf (sent
    exactly, on its own) takes no share: 40 + 60 entries, not 20 + 30."""
    params = {"a": jnp.zeros(4000), "b": jnp.zeros(6000), "s": jnp.zeros(10_000)}
    tx = allreduce_gradients(k=100, fuse=False)
    grads = {"a": jnp.arange(1.0, 4001.0), "b": jnp.arange(1.0, 6001.0),
             "s": sparcml_jax.coalesce(jnp.array([7], jnp.int32), jnp.array([2.0]), size=10_000)}
    sent, _ = jax.jit(tx.update)(grads, tx.init(params))
    assert int((sent["a"] != 0).sum()) == 40 and int((sent["b"] != 0).sum()) == 60
    np.testing.assert_array_equal(np.asarray(sent["s"].to_dense()), np.asarray(grads["s"].to_dense()))


@pytest.mark.parametrize("buckets", [None, 3])
def test_exact_mode_on_one_rank_is_the_identity(buckets):
    params = params_tree()
    tx = allreduce_gradients(buckets=buckets, min_size=16)
    grads = random_grads(np.random.default_rng(1), params)
    grads["dense"]["w"] = grads["dense"]["w"].at[3:].set(0.0)  # naturally sparse
    out, state = jax.jit(tx.update)(grads, tx.init(params))
    for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(grads)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert tree_get(state, "residual") is None  # exact: nothing is ever held back


def test_exact_mode_with_capacity_falls_back_to_dense():
    params = {"w": jnp.zeros(5000)}
    tx = allreduce_gradients(capacity=10)
    grads = {"w": jnp.ones(5000)}  # 5000 nonzeros > capacity: sent dense, still exact
    out, _ = jax.jit(tx.update)(grads, tx.init(params))
    np.testing.assert_array_equal(np.asarray(out["w"]), np.ones(5000))


def test_state_holds_a_few_arrays():
    """A step that communicates pays JAX's dispatch for every state leaf: step counts and keys are
    kept only where something reads them."""
    params = params_tree()
    n = len(jax.tree.leaves(params))
    leaves = lambda **kwargs: len(jax.tree.leaves(allreduce_gradients(**kwargs).init(params)))  # noqa: E731
    assert n > 2
    assert leaves(density=0.01) == 2  # the residual of the one fused buffer and the stats
    assert leaves(density=0.01, fuse=False) == 1 + len([p for p in jax.tree.leaves(params) if p.size >= 1024])
    assert leaves(density=0.01, quantize_bits=4) == 3  # and QSGD's key
    assert leaves(density=0.01, sparsifier="randomk", warmup_steps=5) == 5  # and two counts and randomk's key
    assert leaves() == 1  # the exact mode: the stats


def test_composes_with_adam_and_inject_hyperparams():
    params = params_tree()
    tx = optax.chain(allreduce_gradients(density=0.1, quantize_bits=4),
                     optax.inject_hyperparams(optax.adam)(learning_rate=1e-2))
    grads = random_grads(np.random.default_rng(2), params)
    updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    assert jax.tree.structure(updates) == jax.tree.structure(params)
    # The injected warm-up decides the update: sent whole while warming up, 10 % otherwise.
    injected = optax.inject_hyperparams(allreduce_gradients, static_args=("density", "min_size"))(
        density=0.1, warmup_steps=1)
    update = jax.jit(injected.update)
    warming = injected.init(params)
    done = injected.init(params)
    done.hyperparams["warmup_steps"] = jnp.asarray(0)
    assert int((update(grads, warming, params)[0]["dense"]["w"] != 0).sum()) == 1200
    assert int((update(grads, done, params)[0]["dense"]["w"] != 0).sum()) == 120


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


@pytest.mark.parametrize("kwargs", [dict(density=0.05, sparsifier="randomk", quantize_bits=4), dict(min_size=16),
                                    dict(k=30, error_feedback=False), dict(density=0.05, warmup_steps=3)])
def test_checkpoint_of_the_single_state_layout_continues(kwargs):
    """A state of the single-NamedTuple layout (AllreduceGradientsState) continues where it stopped:
    the chained state holds its residual, step count, key and stats."""
    params = params_tree()
    tx = allreduce_gradients(**kwargs)
    update = jax.jit(tx.update)
    rng = np.random.default_rng(5)
    grads = [random_grads(rng, params) for _ in range(3)]
    state = tx.init(params)
    for g in grads[:2]:
        _, state = update(g, state)
    residual = tree_get(state, "residual")
    reduce_state = state[1]  # (compression, reduce_streams, densify)
    # Keys are kept where something draws from them (randomk, QSGD): both start from the seed and
    # split once a step, so they are equal, as the single layout's one key was.
    keys = [x for x in (tree_get(state[0], "key", ()), reduce_state.key) if not isinstance(x, tuple)]
    assert len(keys) == (2 if "quantize_bits" in kwargs else 0)
    assert all(np.array_equal(keys[0], x) for x in keys)
    old = sparcml_jax.AllreduceGradientsState(  # whose residual is one array per parameter leaf
        residual=jax.tree.map(lambda p: jnp.zeros((0,)), params) if residual is None else
        sparcml_jax.unfuse_leaves(residual, params, min_size=kwargs.get("min_size", 1024)),
        step=jnp.int32(2), key=keys[0] if keys else jnp.zeros(2, jnp.uint32), stats=reduce_state.stats)
    restored = pickle.loads(pickle.dumps(jax.device_get(old)))
    want, want_state = update(grads[2], state)
    got, got_state = update(grads[2], restored)
    assert jax.tree.structure(got_state) == jax.tree.structure(want_state)
    for a, b in zip(jax.tree.leaves((got, got_state)), jax.tree.leaves((want, want_state))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_checkpoint_of_another_configuration_is_rejected_clearly():
    params = params_tree()
    empty = jax.tree.map(lambda p: jnp.zeros((0,)), params)
    old = sparcml_jax.AllreduceGradientsState(empty, jnp.int32(3), jax.random.key_data(jax.random.key(0)),
                                              allreduce_gradients().init(params)[1].stats)
    with pytest.raises(ValueError, match="without error feedback"):
        allreduce_gradients(density=0.1).update(random_grads(np.random.default_rng(0), params), old)


def test_runs_in_one_jitted_step_with_donated_buffers():
    params = params_tree()
    tx = optax.chain(allreduce_gradients(density=0.1), optax.sgd(0.1))

    def loss(p, x):
        h = jnp.tanh(x @ p["dense"]["w"] + p["dense"]["b"])
        return jnp.mean((h @ p["head"][0] + p["head"][1]) ** 2)

    def train_step(p, s, x):
        u, s = tx.update(jax.grad(loss)(p, x), s, p)
        return optax.apply_updates(p, u), s

    params = jax.tree.map(lambda p: p + 0.1, params)
    x = jnp.linspace(-1.0, 1.0, 8 * 40).reshape(8, 40)
    want = jax.jit(train_step)(*jax.jit(train_step)(params, tx.init(params), x), x)
    donated = jax.jit(train_step, donate_argnums=(0, 1))
    got = donated(*donated(jax.tree.map(jnp.copy, params), tx.init(params), x), x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert any(not np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree.leaves(got[0]), jax.tree.leaves(params)))


@pytest.mark.parametrize("value_dtype", [None, jnp.bfloat16])
def test_bfloat16_gradients_reach_the_engine_without_a_float32_copy(value_dtype):
    """A bfloat16 model's fused gradient goes to the native engine as bfloat16 and comes back so:
    the update program holds no float32 array of the fused buffer's length."""
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params_tree())  # fused: w and head[0], 1410 entries
    tx = allreduce_gradients(value_dtype=value_dtype, min_size=100)
    grads = jax.tree.map(lambda p: p + 0.5, params)
    program = jax.jit(tx.update).lower(grads, tx.init(params), params).as_text()
    fused = 40 * 30 + 30 * 7
    assert f"tensor<{fused}xbf16>" in program
    assert f"tensor<{fused}xf32>" not in program
    updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    assert all(u.dtype == jnp.bfloat16 for u in jax.tree.leaves(updates))
    for u, g in zip(jax.tree.leaves(updates), jax.tree.leaves(grads)):
        np.testing.assert_array_equal(np.asarray(u, np.float32), np.asarray(g, np.float32))


@pytest.mark.parametrize("buckets", [None, 1])
def test_warmup_sends_dense(buckets):
    params = {"w": jnp.zeros(4096)}
    tx = allreduce_gradients(density=0.01, warmup_steps=2, buckets=buckets)
    state = tx.init(params)
    update = jax.jit(tx.update)
    g = {"w": jnp.arange(1.0, 4097.0)}
    out, state = update(g, state)
    assert int((out["w"] != 0).sum()) == 4096 and int(tree_get(state, "stats").algorithm) == -1
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
    (dict(quantize_feedback=True), "needs quantize_bits"),
    (dict(quantize_bits=4, quantize_feedback=True, density=0.01), r"no density or k \(top-k segments"),
    (dict(quantize_bits=4, quantize_feedback=True, buckets=2), "no buckets"),
    (dict(algorithm="spardl", density=0.01, quantize_feedback=True), "does not take quantize_feedback"),
    (dict(value_dtype=jnp.float16), "value_dtype must be jnp.float32 or jnp.bfloat16"),
    (dict(value_dtype=jnp.bfloat16, density=0.01, buckets=2), "runs blocking reductions"),
    (dict(algorithm="gtopk", density=0.01, value_dtype=jnp.bfloat16), "does not take value_dtype"),
])
def test_bad_configuration_is_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        allreduce_gradients(**kwargs)


def test_integer_leaves_are_rejected():
    tx = allreduce_gradients(density=0.1)
    with pytest.raises(TypeError, match="only floating-point"):
        tx.init({"w": jnp.zeros(3), "count": jnp.zeros(3, jnp.int32)})


def test_mismatched_pytree_is_rejected():
    tx = allreduce_gradients(density=0.1, min_size=0)
    params = {"w": jnp.zeros(3)}
    state = tx.init(params)
    with pytest.raises(ValueError, match="the gradient has 2 leaves and the parameters 1"):
        tx.update({"v": jnp.zeros(3), "w": jnp.zeros(3)}, state, params)
    with pytest.raises(ValueError, match=r"gradient leaf 0 has shape \(4,\) but its parameter has shape \(3,\)"):
        tx.update({"w": jnp.zeros(4)}, state, params)
    # Without the parameters, the fused buffers' sizes are checked against the residual's.
    with pytest.raises(ValueError, match=r"fused buffers have shapes \[\(4,\)\], but the residual that init made"):
        tx.update({"w": jnp.zeros(4)}, state)


def test_dense_baseline_transform():
    tx = sparcml_jax.dense_allreduce_gradients()
    out, _ = jax.jit(tx.update)({"w": jnp.arange(3.0)}, tx.init({"w": jnp.zeros(3)}))
    np.testing.assert_array_equal(np.asarray(out["w"]), [0.0, 1.0, 2.0])


def test_join_flat_places_every_leaf_and_split_like_cuts_them_back():
    from sparcml_jax.stages import join_flat, shapes_and_dtypes, split_like

    leaves = [jnp.arange(6.0).reshape(2, 3), jnp.array([7.0]), jnp.zeros((0,)), jnp.arange(4.0, dtype=jnp.bfloat16)]
    flat = jax.jit(lambda xs: join_flat(xs, jnp.float32))(leaves)
    want = np.concatenate([np.ravel(np.asarray(x, np.float32)) for x in leaves])
    np.testing.assert_array_equal(np.asarray(flat), want)
    for got, want in zip(split_like(flat, shapes_and_dtypes(leaves)), leaves):
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_join_flat_beyond_int32_entries():
    """A bfloat16 model's fused buffer may pass 2^31 entries: the join counts in bytes, not int32 offsets."""
    from sparcml_jax.stages import join_flat

    huge = [jax.ShapeDtypeStruct((2**31,), jnp.bfloat16), jax.ShapeDtypeStruct((10,), jnp.bfloat16)]
    joined = jax.jit(lambda xs: join_flat(xs, jnp.bfloat16)).lower(huge)
    assert joined.out_info.shape == (2**31 + 10,) and "sparcml_pack" in joined.as_text()


class _StatsAsThreeFields(NamedTuple):
    density: jax.Array
    bytes_sent: jax.Array
    algorithm: jax.Array


def test_state_that_keeps_every_count_and_key_continues(monkeypatch):
    """A chained state written when every stage kept its count and key (arrays where the stages now
    keep ``()``), the residual one array per parameter leaf and the stats three fields, updates
    exactly like the current one."""
    params = params_tree()
    tx = allreduce_gradients(density=0.05, min_size=16)
    update = jax.jit(tx.update)
    rng = np.random.default_rng(7)
    feedback, reduce, densify = tx.init(params)
    _, (feedback, reduce, densify) = update(random_grads(rng, params), (feedback, reduce, densify))
    grads = random_grads(rng, params)
    stats = _StatsAsThreeFields(reduce.stats.density, reduce.stats.bytes_sent, reduce.stats.algorithm)
    older = (feedback._replace(residual=sparcml_jax.unfuse_leaves(feedback.residual, params, min_size=16),
                               inner=sparcml_jax.SparsifyState(jnp.int32(4), jnp.zeros(2, jnp.uint32))),
             reduce._replace(count=jnp.int32(4), key=jnp.zeros(2, jnp.uint32), stats=stats), densify)
    with monkeypatch.context() as patch:  # pickled as the three-field class of that name was
        _StatsAsThreeFields.__module__, _StatsAsThreeFields.__qualname__ = "sparcml_jax.stages", "GradientStats"
        patch.setattr(sparcml_jax.stages, "GradientStats", _StatsAsThreeFields)
        saved = pickle.dumps(jax.device_get(older))
    restored = pickle.loads(saved)
    assert isinstance(restored[1].stats, sparcml_jax.GradientStats)
    assert float(restored[1].stats.density) == float(reduce.stats.density) > 0
    want, want_state = update(grads, (feedback, reduce, densify))
    got, got_state = update(grads, restored)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(got_state[0].residual), jax.tree.leaves(want_state[0].residual)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    again, _ = update(grads, got_state)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(update(grads, want_state)[0])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("fuse,buckets", [(False, None), (True, 2)])
def test_state_with_a_residual_per_leaf_continues_whatever_the_plan(fuse, buckets):
    """Parameters that are a tuple of equal vectors: a residual per leaf and one per fused buffer
    (here: per bucket, in reverse order) have the same shapes; the layout is told by its type."""
    params = (jnp.zeros(2048), jnp.zeros(2048))
    tx = allreduce_gradients(density=0.01, fuse=fuse, buckets=buckets)
    update = jax.jit(tx.update)
    rng = np.random.default_rng(11)
    _, state = update(random_grads(rng, params), tx.init(params))
    grads = random_grads(rng, params)
    feedback, *rest = state
    per_leaf = sparcml_jax.unfuse_leaves(feedback.residual, params, fuse=fuse, buckets=buckets)
    assert not np.array_equal(np.asarray(per_leaf[0]), np.asarray(per_leaf[1]))
    older = (feedback._replace(residual=per_leaf), *rest)
    (want, want_state), (got, got_state) = update(grads, state), update(grads, older)
    for a, b in zip(jax.tree.leaves((want, want_state)), jax.tree.leaves((got, got_state))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_unfuse_leaves_names_the_plan_it_needs():
    params = params_tree()
    tx = allreduce_gradients(density=0.1, min_size=16)
    residual = tree_get(tx.update(random_grads(np.random.default_rng(9), params), tx.init(params))[1], "residual")
    per_leaf = sparcml_jax.unfuse_leaves(residual, params, min_size=16)
    assert jax.tree.structure(per_leaf) == jax.tree.structure(params)
    np.testing.assert_array_equal(np.asarray(per_leaf["head"][1]), np.zeros(7))  # small: sent whole, nothing held
    with pytest.raises(ValueError, match="pass the min_size, fuse and buckets of the transform"):
        sparcml_jax.unfuse_leaves(residual, params)  # the default min_size plans no group here
    with pytest.raises(TypeError, match="pass the state's residual"):
        sparcml_jax.unfuse_leaves(params, params)


def test_gradient_stats_is_one_vector_read_by_name():
    stats = sparcml_jax.GradientStats(0.25, bytes_sent=1024.0, algorithm=2)
    assert len(jax.tree.leaves(stats)) == 1 and stats.values.dtype == jnp.float32
    assert (float(stats.density), float(stats.bytes_sent), int(stats.algorithm)) == (0.25, 1024.0, 2)
    assert stats.algorithm.dtype == jnp.int32
    changed = stats._replace(algorithm=-1)
    assert int(changed.algorithm) == -1 and float(changed.density) == 0.25
    stacked = jax.vmap(lambda d: sparcml_jax.GradientStats(d, d, 3))(jnp.arange(4.0))
    assert stacked.density.tolist() == [0.0, 1.0, 2.0, 3.0] and stacked.algorithm.tolist() == [3] * 4
    with pytest.raises(TypeError, match=r"takes density, bytes_sent and algorithm .* got \['bytes_sent', 'density'\]"):
        sparcml_jax.GradientStats(0.5, 1.0)
    with pytest.raises(ValueError, match="has no field"):
        stats._replace(nnz=3)


@pytest.mark.parametrize("options", [dict(buckets=2), dict(transport="mpi4jax"), dict(algorithm="spardl"),
                                     dict(density=None, capacity=5), dict(axis_name="i"),
                                     dict(density=None, quantize_bits=4, quantize_feedback=True)])
def test_unordered_needs_one_native_collective(options):
    with pytest.raises(ValueError, match="ordered=False makes one unordered MPI call per step"):
        sparcml_jax.allreduce_gradients(**{"density": 0.1, **options}, ordered=False)


def test_unordered_call_must_be_its_programs_only_mpi_call():
    """Two unordered collectives in one program (one update's, two updates', a loop's and the code
    after it) raise as the step is traced; beside an mpi4jax call, as it is lowered. Eagerly each
    call is a program of its own, and alone in a jitted one it carries no effect."""
    import mpi4jax
    from mpi4py import MPI

    params = {"w": jnp.zeros((30, 40)), "v": jnp.zeros(3000)}
    tx = sparcml_jax.allreduce_gradients(density=0.1, fuse=False, ordered=False)
    second = "a second MPI call without JAX's ordered effect"
    with pytest.raises(ValueError, match=second):
        jax.jit(tx.update)(params, tx.init(params))
    tx.update(params, tx.init(params))
    one = sparcml_jax.allreduce_gradients(density=0.1, ordered=False)
    state = one.init(params)
    assert not jax.make_jaxpr(one.update)(params, state).effects
    with pytest.raises(ValueError, match=second):
        jax.jit(lambda g, s: (one.update(g, s), one.update(g, s)))(params, state)
    with pytest.raises(ValueError, match=second):
        jax.jit(lambda g, s: (jax.lax.fori_loop(0, 2, lambda i, s: one.update(g, s)[1], s), one.update(g, s)))(
            params, state)
    with pytest.raises(ValueError, match="mixes an MPI call without JAX's ordered effect"):
        jax.jit(lambda g, s: (one.update(g, s), mpi4jax.allreduce(jnp.ones(1), op=MPI.SUM)))(params, state)
