"""Single-process tests of allreduce_gradients with a global top-k algorithm (P = 1: the
collective's result is this rank's top k of gradient + residual, and the rest is its residual)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import sparcml_jax
from sparcml_jax import ALGORITHMS, GLOBAL_TOPK_ALGORITHMS, allreduce_gradients, global_topk_reduce

tree_get = optax.tree_utils.tree_get


def params_tree():
    return {"dense": {"w": jnp.zeros((40, 30)), "b": jnp.zeros(30)}, "head": (jnp.zeros((30, 7)), jnp.zeros(7))}


def integer_grads(rng, tree):
    """Small integers: every float32 sum of them below 2**24 is exact, so the books balance exactly."""
    return jax.tree.map(lambda p: jnp.asarray(rng.integers(-4, 5, p.shape).astype(np.float32)), tree)


def _flat(tree):
    return np.concatenate([np.asarray(x).ravel() for x in jax.tree.leaves(tree)])


def held(state, params, **planned):
    """The residual per parameter leaf."""
    return sparcml_jax.unfuse_leaves(tree_get(state, "residual"), params, **planned)


@pytest.mark.parametrize("algorithm", GLOBAL_TOPK_ALGORITHMS)
@pytest.mark.parametrize("fuse,min_size", [(True, 16), (False, 16), (True, 0)])
def test_books_balance_over_steps(algorithm, fuse, min_size):
    """Everything sent plus the residual is the sum of every gradient, after every step."""
    params = params_tree()
    tx = allreduce_gradients(density=0.05, algorithm=algorithm, fuse=fuse, min_size=min_size)
    state, update = tx.init(params), jax.jit(tx.update)
    rng = np.random.default_rng(0)
    total_grads = jax.tree.map(jnp.zeros_like, params)
    total_sent = jax.tree.map(jnp.zeros_like, params)
    for _ in range(30):
        grads = integer_grads(rng, params)
        sent, state = update(grads, state)
        total_grads = jax.tree.map(jnp.add, total_grads, grads)
        total_sent = jax.tree.map(jnp.add, total_sent, sent)
        residual = held(state, params, fuse=fuse, min_size=min_size)
        np.testing.assert_array_equal(_flat(total_sent) + _flat(residual), _flat(total_grads))
    assert float(np.abs(_flat(residual)).sum()) > 0  # something was held back


@pytest.mark.parametrize("algorithm,steps", [("spardl", 2), ("gtopk", 2), ("oktopk", 1)])
def test_sends_the_top_k_of_gradient_plus_residual(algorithm, steps):
    """Step 1 sends the k largest magnitudes; step 2 the k largest of the new gradient plus what
    step 1 held back, exactly as a hand computation of error feedback. (Ok-Topk selects the exact
    top k on its first step only; then by thresholds it estimates.)"""
    n, k = 5000, 123
    rng = np.random.default_rng(1)
    grads = [rng.permutation(n).astype(np.float32) * rng.choice([-1, 1], n) for _ in range(steps)]
    tx = allreduce_gradients(k=k, algorithm=algorithm)
    state, update = tx.init({"w": jnp.zeros(n)}), jax.jit(tx.update)
    residual = np.zeros(n, np.float32)
    for g in grads:
        sent, state = update({"w": jnp.asarray(g)}, state)
        acc = g + residual
        want = np.zeros(n, np.float32)
        top = np.argsort(-np.abs(acc), kind="stable")[:k]
        want[top] = acc[top]
        residual = acc - want
        np.testing.assert_array_equal(np.asarray(sent["w"]), want)
        np.testing.assert_array_equal(np.asarray(held(state, {"w": g})["w"]), residual)


@pytest.mark.parametrize("algorithm", GLOBAL_TOPK_ALGORITHMS)
def test_stats_count_the_result(algorithm):
    params = params_tree()  # fused: 40*30 + 30*7 = 1410 entries; small: 30 + 7
    tx = allreduce_gradients(density=0.01, algorithm=algorithm, min_size=100)
    _, state = jax.jit(tx.update)(integer_grads(np.random.default_rng(2), params), tx.init(params))
    stats = tree_get(state, "stats")
    assert float(stats.density) == pytest.approx(15 / 1410)  # ceil(1 % of 1410) entries
    assert (ALGORITHMS + GLOBAL_TOPK_ALGORITHMS)[int(stats.algorithm)] == algorithm
    assert float(stats.bytes_sent) == 0.0  # one process sends nothing


def test_small_leaves_travel_whole():
    params = params_tree()
    tx = allreduce_gradients(density=0.01, algorithm="spardl", min_size=100)
    grads = integer_grads(np.random.default_rng(3), params)
    sent, state = jax.jit(tx.update)(grads, tx.init(params))
    for path in (("dense", "b"), ("head", 1)):
        got, want = sent, grads
        for p in path:
            got, want = got[p], want[p]
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert [r.shape for r in tree_get(state, "residual").buffers] == [(1410,)]  # small leaves hold nothing back


def test_warmup_sends_dense_then_the_top_k():
    params = {"w": jnp.zeros(2000)}
    tx = allreduce_gradients(k=10, algorithm="gtopk", warmup_steps=1)
    update = jax.jit(tx.update)
    grads = {"w": jnp.arange(1.0, 2001.0)}
    sent, state = update(grads, tx.init(params))
    np.testing.assert_array_equal(np.asarray(sent["w"]), np.asarray(grads["w"]))
    assert int(tree_get(state, "stats").algorithm) == -1 and not np.any(np.asarray(held(state, params)["w"]))
    sent, state = update(grads, state)
    assert int((sent["w"] != 0).sum()) == 10
    assert GLOBAL_TOPK_ALGORITHMS[int(tree_get(state, "stats").algorithm) - len(ALGORITHMS)] == "gtopk"


def test_oktopk_carries_its_estimates_in_the_state():
    """One OktopkState per fused buffer: its step counts the updates (not the warm-up ones), and
    its thresholds are estimated from the first step on."""
    params = {"a": jnp.zeros(3000), "b": jnp.zeros(2000)}
    tx = allreduce_gradients(density=0.02, algorithm="oktopk", fuse=False, warmup_steps=1)
    update = jax.jit(tx.update)
    state = tx.init(params)
    assert len(tree_get(state, "oktopk")) == 2 and int(tree_get(state, "oktopk")[0].step) == 0
    rng = np.random.default_rng(4)
    grads = [jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape).astype(np.float32)), params)
             for _ in range(3)]
    for g in grads:
        _, state = update(g, state)
    carried = tree_get(state, "oktopk")
    assert [int(c.step) for c in carried] == [2, 2]  # the warm-up step summed dense
    assert all(float(c.local_threshold) > 0 for c in carried)


def test_without_error_feedback_the_rest_is_dropped():
    params = {"w": jnp.zeros(2000)}
    tx = allreduce_gradients(k=10, algorithm="spardl", error_feedback=False)
    state, update = tx.init(params), jax.jit(tx.update)
    grads = {"w": jnp.arange(1.0, 2001.0)}
    for _ in range(2):  # the same 10 entries both times: nothing accumulates
        sent, state = update(grads, state)
        np.testing.assert_array_equal(np.nonzero(np.asarray(sent["w"]))[0], np.arange(1990, 2000))
    assert tree_get(state, "residual") is None


def test_stream_leaves_are_summed_exactly():
    params = {"w": jnp.zeros(3000), "s": jnp.zeros(10_000)}
    tx = allreduce_gradients(k=30, algorithm="spardl")
    stream = sparcml_jax.coalesce(jnp.array([7, 9000], jnp.int32), jnp.array([2.0, -1.0]), size=10_000)
    sent, state = jax.jit(tx.update)({"w": jnp.arange(3000.0), "s": stream}, tx.init(params))
    np.testing.assert_array_equal(np.asarray(sent["s"].to_dense()), np.asarray(stream.to_dense()))
    assert int((sent["w"] != 0).sum()) == 30
    assert float(tree_get(state, "stats").density) == pytest.approx(32 / 13_000)


def test_composes_with_partition_adam_and_a_jitted_step():
    """A global top-k for the embedding, an exact sum for the head, adam after both."""
    params = {"embed": jnp.zeros(2000), "head": jnp.zeros(10)}
    reducer = optax.partition({"sparse": allreduce_gradients(density=0.01, algorithm="gtopk", min_size=0),
                               "exact": allreduce_gradients()}, {"embed": "sparse", "head": "exact"})
    tx = optax.chain(reducer, optax.adam(1e-2))

    @jax.jit
    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    p, s = params, tx.init(params)
    grads = {"embed": jnp.arange(2000.0), "head": jnp.ones(10)}
    for _ in range(3):
        p, s = step(p, s, grads)
    sparse_state = s[0].inner_states["sparse"]
    assert float(tree_get(sparse_state, "stats").density) == pytest.approx(0.01)
    assert int((p["embed"] != 0).sum()) <= 3 * 20 and int((p["head"] != 0).sum()) == 10
    assert float(sparcml_jax.unfuse_leaves(tree_get(sparse_state, "residual"), {"embed": params["embed"]},
                                           min_size=0)["embed"].sum()) > 0


def test_the_stage_alone_sums_every_dense_leaf_as_its_own_buffer():
    params = {"a": jnp.zeros(100), "b": jnp.zeros((10, 30))}
    tx = optax.chain(global_topk_reduce(k=40, algorithm="spardl"), sparcml_jax.densify())
    grads = {"a": jnp.arange(100.0), "b": jnp.arange(300.0).reshape(10, 30)}
    sent, state = jax.jit(tx.update)(grads, tx.init(params), params)
    assert int((sent["a"] != 0).sum()) == 10 and int((sent["b"] != 0).sum()) == 30  # k shared 1 : 3
    residual = tree_get(state, "residual").buffers  # one buffer per leaf, as the stage sums them
    assert [r.shape for r in residual] == [(100,), (300,)]
    np.testing.assert_array_equal(np.asarray(sent["b"]).ravel() + np.asarray(residual[1]), np.asarray(grads["b"]).ravel())


@pytest.mark.parametrize("kwargs,match", [
    (dict(quantize_bits=4), "quantize_bits"),
    (dict(bucket_size=512), "bucket_size"),
    (dict(quantize_scale="l2"), "quantize_scale"),
    (dict(sparsifier="randomk"), "sparsifier"),
    (dict(sparsifier=lambda v, k, key: sparcml_jax.topk(v, k)), "sparsifier"),
    (dict(buckets=2), "buckets"),
    (dict(cost_model=sparcml_jax.CostModel(alpha=1e-6, beta=1e-9)), "cost_model"),
    (dict(density=None), "needs density or k"),
    (dict(capacity=100), "capacity"),
])
def test_arguments_without_use_are_rejected_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        allreduce_gradients(**{"density": 0.01, "algorithm": "spardl", **kwargs})


@pytest.mark.parametrize("kwargs,match", [
    (dict(algorithm="gtopk", teams=2), "teams is a keyword of algorithm='spardl'"),
    (dict(algorithm="auto", teams=1), "teams is a keyword of algorithm='spardl'"),
    (dict(algorithm="spardl", tau=4), "tau is a keyword of algorithm='oktopk'"),
    (dict(algorithm="ssar_recursive_doubling", tau_prime=4), "tau_prime is a keyword of algorithm='oktopk'"),
    (dict(algorithm="spardl", teams=0), "teams must be a static int >= 1"),
    (dict(algorithm="oktopk", tau=0), "tau must be a static int >= 1"),
    (dict(algorithm="oktopk", tau_prime=2.5), "tau_prime must be a static int >= 1"),
])
def test_algorithm_keywords_belong_to_their_algorithm(kwargs, match):
    with pytest.raises(ValueError, match=match):
        allreduce_gradients(density=0.01, **kwargs)


def test_oktopk_intervals_reach_the_collective():
    """With tau=1 every step evaluates its thresholds exactly: it sends the top k of gradient plus
    residual, and its global threshold is their k-th magnitude. With the default tau=128 the
    later steps move the thresholds by Ok-Topk's factors instead."""
    params = {"w": jnp.zeros(3000)}
    rng = np.random.default_rng(9)
    grads = [{"w": jnp.asarray(rng.standard_normal(3000).astype(np.float32))} for _ in range(3)]
    final = {}
    for tau in (1, 128):
        tx = allreduce_gradients(k=30, algorithm="oktopk", tau=tau, tau_prime=tau)
        state, update = tx.init(params), jax.jit(tx.update)
        for g in grads:
            accumulated = np.asarray(g["w"] + held(state, params)["w"])
            sent, state = update(g, state)
            kth = np.sort(np.abs(accumulated))[-30]
            if tau == 1:
                np.testing.assert_array_equal(np.nonzero(np.asarray(sent["w"]))[0],
                                              np.sort(np.argsort(-np.abs(accumulated))[:30]))
                assert float(tree_get(state, "oktopk")[0].global_threshold) == kth
        final[tau] = float(tree_get(state, "oktopk")[0].global_threshold), kth
    assert final[128][0] != final[128][1]  # moved, not re-evaluated


def test_unknown_algorithm_names_both_families():
    with pytest.raises(ValueError, match="spardl"):
        allreduce_gradients(density=0.01, algorithm="sparDL")


def test_a_single_state_checkpoint_does_not_continue_a_global_top_k():
    params = {"w": jnp.zeros(2000)}
    old = allreduce_gradients(density=0.01)
    single = sparcml_jax.AllreduceGradientsState(
        {"w": jnp.zeros(2000)}, jnp.zeros((), jnp.int32), jax.random.key_data(jax.random.key(0)),
        tree_get(old.init(params), "stats"))
    with pytest.raises(ValueError, match="tx.init"):
        allreduce_gradients(density=0.01, algorithm="spardl").update({"w": jnp.ones(2000)}, single)


def test_a_stream_leaf_leaves_its_buffer_and_its_residual_waits():
    """A leaf that arrives as a stream is summed exactly outside the fused buffer; the other
    leaves' residual follows them, and the stream leaf's segment is kept for when it comes back
    dense: the books still balance on every leaf."""
    params = {"a": jnp.zeros(3000), "s": jnp.zeros(2000)}
    tx = allreduce_gradients(k=50, algorithm="spardl", min_size=0)
    state, update = tx.init(params), jax.jit(tx.update)
    rng = np.random.default_rng(11)
    total_grads, total_sent = jax.tree.map(jnp.zeros_like, params), jax.tree.map(jnp.zeros_like, params)
    for step in range(4):
        grads = integer_grads(rng, params)
        given = grads
        if step == 2:
            given = {"a": grads["a"], "s": sparcml_jax.from_dense(grads["s"])}
        sent, state = update(given, state)
        sent = {"a": sent["a"], "s": sent["s"].to_dense() if step == 2 else sent["s"]}
        total_grads = jax.tree.map(jnp.add, total_grads, grads)
        total_sent = jax.tree.map(jnp.add, total_sent, sent)
        residual = held(state, params, min_size=0)
        for name in params:
            np.testing.assert_array_equal(np.asarray(total_sent[name] + residual[name]), np.asarray(total_grads[name]))
        if step == 2:  # the stream leaf's segment waited, untouched
            np.testing.assert_array_equal(np.asarray(residual["s"]), np.asarray(before["s"]))
        before = residual
    assert float(np.abs(np.asarray(before["s"])).sum()) > 0


def test_a_residual_kept_per_leaf_continues():
    """A state whose residual is one array per parameter leaf (as states were kept before the
    residual moved onto the fused buffers) updates exactly as its fused form does."""
    params = params_tree()
    tx = allreduce_gradients(density=0.05, algorithm="gtopk", min_size=16)
    update = jax.jit(tx.update)
    rng = np.random.default_rng(12)
    _, state = update(integer_grads(rng, params), tx.init(params))
    older = state[0]._replace(residual=held(state, params, min_size=16))
    grads = integer_grads(rng, params)
    sent, new = update(grads, (older, *state[1:]))
    want_sent, want = update(grads, state)
    np.testing.assert_array_equal(_flat(sent), _flat(want_sent))
    for got, expected in zip(tree_get(new, "residual").buffers, tree_get(want, "residual").buffers):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
    with pytest.raises(ValueError, match="re-run init"):
        update(grads, (state[0]._replace(residual={"w": jnp.zeros(3)}), *state[1:]))
