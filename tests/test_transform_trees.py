"""The optax transformation on real model parameter trees (Flax NNX and Equinox), single process.

P = 1, so the allreduce returns what this rank sent: exact mode is the identity, and with a
density the update is the sparsified gradient plus error feedback. Checkpoints of the whole
optimizer state (pickle and orbax) must restore into a run that continues bit-identically.
"""

import math
import pickle

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx, serialization

import sparcml_jax

tree_get = optax.tree_utils.tree_get
MIN_SIZE = 16  # leaves below this travel dense; the rest are sparsified as one fused buffer
DENSITY = 0.05


def flax_model(seed=0):
    """A two-layer NNX MLP; returns its Param state and ``apply(params, x)``."""
    rngs = nnx.Rngs(seed)
    model = nnx.Sequential(nnx.Linear(8, 64, rngs=rngs), nnx.relu, nnx.Linear(64, 1, rngs=rngs))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return params, lambda p, x: nnx.merge(graphdef, p, rest)(x)


def equinox_model(seed=0):
    """A three-layer Equinox MLP; returns its inexact-array partition and ``apply(params, x)``."""
    model = eqx.nn.MLP(8, 1, 64, 2, key=jax.random.key(seed))
    params, static = eqx.partition(model, eqx.is_inexact_array)
    return params, lambda p, x: jax.vmap(eqx.combine(p, static))(x)


MODELS = {"flax": flax_model, "equinox": equinox_model}


def toy_data(n=64):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, 8)).astype(np.float32)
    y = (np.sin(x[:, :1]) + 0.5 * x[:, 1:2] * x[:, 2:3]).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(y)


def make_loss(apply):
    def loss(p, x, y):
        return jnp.mean((apply(p, x) - y) ** 2)
    return loss


def make_step(tx, loss):
    """One jitted training step; also returns the gradients it fed to ``tx``."""
    @jax.jit
    def step(p, s, x, y):
        g = jax.grad(loss)(p, x, y)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, g
    return step


def leaves_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b) and len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("library,buckets", [("flax", None), ("equinox", None), ("equinox", 2), ("flax", 2)])
def test_trains_a_model_tree_with_error_feedback(library, buckets):
    params, apply = MODELS[library]()
    loss = make_loss(apply)
    x, y = toy_data()
    sparse = sparcml_jax.allreduce_gradients(density=DENSITY, min_size=MIN_SIZE, buckets=buckets)
    tx = optax.chain(sparse, optax.adam(1e-2))
    step = make_step(tx, loss)

    p, s = params, tx.init(params)
    # The residual is one vector per fused buffer; unfuse_leaves shows it in the parameter tree (Flax
    # State of Params, Equinox module with None holes).
    large = sum(q.size for q in jax.tree.leaves(params) if q.size >= MIN_SIZE)
    residual = tree_get(s, "residual").buffers
    assert sum(r.size for r in residual) == large and len(residual) == (buckets or 1)
    per_leaf = sparcml_jax.unfuse_leaves(tree_get(s, "residual"), params, min_size=MIN_SIZE, buckets=buckets)
    assert jax.tree.structure(per_leaf) == jax.tree.structure(params)
    for r, q in zip(jax.tree.leaves(per_leaf), jax.tree.leaves(params)):
        assert r.shape == q.shape
    grads = []
    for _ in range(25):
        p, s, g = step(p, s, x, y)
        grads.append(g)
    assert jax.tree.structure(p) == jax.tree.structure(params)
    assert float(loss(p, x, y)) < 0.9 * float(loss(params, x, y))
    assert int(s[1][0].count) == 25  # adam's count: the state went through every step

    # Replay the first transform alone on the same gradients: it is deterministic, so it sends what
    # the chain sent and ends with the chain's residual; sent + residual accounts for every gradient.
    update = jax.jit(sparse.update)
    s1 = sparse.init(params)
    sizes = [q.size for q in jax.tree.leaves(params)]
    # ceil(5 %) of the fused buffer (each bucket rounds up on its own) plus the small leaves, sent dense.
    budget = (math.ceil(DENSITY * sum(n for n in sizes if n >= MIN_SIZE)) + (buckets or 1) - 1
              + sum(n for n in sizes if n < MIN_SIZE))
    total_sent = [np.zeros(q.shape, np.float64) for q in jax.tree.leaves(params)]
    for g in grads:
        sent, s1 = update(g, s1)
        assert jax.tree.structure(sent) == jax.tree.structure(params)
        sent = [np.asarray(leaf) for leaf in jax.tree.leaves(sent)]
        assert 0 < sum(int(np.count_nonzero(leaf)) for leaf in sent) <= budget  # about 5 % of the buffer
        total_sent = [t + leaf for t, leaf in zip(total_sent, sent)]
    leaves_equal(tree_get(s1, "residual"), tree_get(s, "residual"))
    residual = [np.asarray(r) for r in jax.tree.leaves(
        sparcml_jax.unfuse_leaves(tree_get(s1, "residual"), params, min_size=MIN_SIZE, buckets=buckets))]
    assert any(np.abs(r).max() > 0 for r in residual)  # something was held back
    total_grads = [sum(np.asarray(leaf, np.float64) for leaf in leaves) for leaves in zip(*map(jax.tree.leaves, grads))]
    for sent, r, want in zip(total_sent, residual, total_grads):
        np.testing.assert_allclose(sent + r, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("library,buckets", [("flax", None), ("equinox", None), ("equinox", 2), ("flax", 2)])
def test_exact_mode_is_the_identity_on_model_grads(library, buckets):
    params, apply = MODELS[library]()
    x, y = toy_data()
    g = jax.grad(make_loss(apply))(params, x, y)
    tx = sparcml_jax.allreduce_gradients(min_size=MIN_SIZE, buckets=buckets)
    out, state = jax.jit(tx.update)(g, tx.init(params))
    leaves_equal(out, g)
    assert tree_get(state, "residual") is None


def save_restore(kind, tree, tmp_path):
    """Round-trips ``tree``, (parameters, optimizer state), through pickle, Flax's msgpack or an
    orbax checkpoint on disk."""
    if kind == "pickle":
        return pickle.loads(pickle.dumps(jax.device_get(tree)))
    if kind == "msgpack":  # the transform's own state (Flax's msgpack takes no NNX State or Equinox module)
        p, (ours, *rest) = tree
        return p, (serialization.from_bytes(ours, serialization.to_bytes(jax.device_get(ours))), *rest)
    path = tmp_path / "ckpt"
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, tree)
        ckptr.wait_until_finished()
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
    with ocp.StandardCheckpointer() as ckptr:
        return ckptr.restore(path, target)


@pytest.mark.parametrize("kind", ["orbax", "pickle", "msgpack"])
@pytest.mark.parametrize("library", ["flax", "equinox"])
def test_checkpoint_restore_continues_bit_identically(library, kind, tmp_path):
    params, apply = MODELS[library]()
    x, y = toy_data()
    # randomk and QSGD draw from the PRNG key kept in the state, so the key must be restored too.
    tx = optax.chain(sparcml_jax.allreduce_gradients(density=DENSITY, min_size=MIN_SIZE, sparsifier="randomk",
                                                     quantize_bits=4),
                     optax.adam(1e-2))
    step = make_step(tx, make_loss(apply))
    p, s = params, tx.init(params)
    for _ in range(4):
        p, s, _ = step(p, s, x, y)
    p2, s2 = save_restore(kind, (p, s), tmp_path)
    assert jax.tree.structure((p2, s2)) == jax.tree.structure((p, s))
    assert isinstance(tree_get(s2, "stats"), sparcml_jax.GradientStats)
    leaves_equal((p2, s2), (p, s))
    p_mid, s_mid = p2, s2

    for _ in range(4):  # the uninterrupted run: 8 steps in all
        p, s, _ = step(p, s, x, y)
    for _ in range(4):  # the restored run
        p2, s2, _ = step(p2, s2, x, y)
    leaves_equal((p2, s2), (p, s))
    assert int(s2[1][0].count) == 8

    # Controls: the comparison can tell a lost state apart. Resuming with a fresh optimizer state,
    # or with only the sparsifier's PRNG key replaced, ends elsewhere.
    # (The fresh state goes through the same checkpoint round trip, so the step does not recompile.)
    fresh = save_restore(kind, (params, tx.init(params)), tmp_path / "fresh")[1]
    feedback, reduce, densify = s_mid[0]  # replace the sparsifier's key (randomk draws from it)
    other_key = ((feedback._replace(inner=feedback.inner._replace(key=feedback.inner.key + 1)), reduce, densify),
                 *s_mid[1:])
    for sc in (fresh, other_key):
        pc = p_mid
        for _ in range(4):
            pc, sc, _ = step(pc, sc, x, y)
        assert any(not np.array_equal(np.asarray(a), np.asarray(b))
                   for a, b in zip(jax.tree.leaves(pc), jax.tree.leaves(p)))
