"""The optax transformation on several ranks: every rank holds identical parameters after every
step, exact mode matches a dense allreduce, and the error-feedback invariant holds per rank."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import sparcml_jax
from _util import COMM, RANK, run_and_agree


def _params():
    return {"w": jnp.zeros((30, 40)), "b": jnp.zeros(40), "v": jnp.zeros(3000)}


def _grads(step: int):
    rng = np.random.default_rng([step, RANK])
    tree = _params()
    return jax.tree.map(lambda p: jnp.asarray(rng.integers(-4, 5, p.shape).astype(np.float32)), tree)


def _identical_everywhere(tree, what):
    mine = np.concatenate([np.asarray(x).ravel() for x in jax.tree.leaves(tree)])
    first = COMM.bcast(mine, root=0)
    return [] if np.array_equal(mine, first) else [f"{what}: rank differs from rank 0"]


def test_identical_parameters_after_every_step():
    def check():
        failures = []
        for reducer in (sparcml_jax.allreduce_gradients(density=0.02, min_size=100),
                        sparcml_jax.allreduce_gradients(k=50, quantize_bits=4, algorithm="dsar_split_allgather"),
                        sparcml_jax.allreduce_gradients(density=0.05, sparsifier="randomk", fuse=False,
                                                        transport="mpi4jax", warmup_steps=1),
                        sparcml_jax.allreduce_gradients(density=0.05, buckets=2, warmup_steps=1, min_size=100),
                        sparcml_jax.allreduce_gradients(k=50, buckets=2, quantize_bits=2,
                                                        algorithm="dsar_split_allgather")):
            tx = optax.chain(reducer, optax.adam(1e-2))
            params, state = _params(), tx.init(_params())

            @jax.jit
            def step(p, s, g):
                u, s = tx.update(g, s, p)
                return optax.apply_updates(p, u), s

            for t in range(5):
                params, state = step(params, state, _grads(t))
                failures += _identical_everywhere(params, f"step {t}")
        return failures

    run_and_agree(check, "identical parameters")


@pytest.mark.parametrize("options", [dict(capacity=2000), dict(buckets=2)])
def test_exact_mode_equals_dense_sum(options):
    def check():
        tx = sparcml_jax.allreduce_gradients(average=False, **options)
        state = tx.init(_params())
        grads = jax.tree.map(lambda g: jnp.where(jnp.abs(g) > 2, g, 0.0), _grads(11))  # sparse, integers
        out, state = jax.jit(tx.update)(grads, state)
        want = jax.tree.map(lambda g: np.sum(COMM.allgather(np.asarray(g)), axis=0), grads)
        return [f"leaf {i} differs" for i, (a, b) in enumerate(zip(jax.tree.leaves(out), jax.tree.leaves(want)))
                if not np.array_equal(np.asarray(a), b)]

    run_and_agree(check, "exact mode")


@pytest.mark.parametrize("buckets", [None, 3])
def test_update_is_the_sum_of_what_ranks_took_from_their_residuals(buckets):
    """sum over ranks of (gradient + old residual - new residual) == the update, every step."""

    def check():
        tx = sparcml_jax.allreduce_gradients(density=0.03, average=False, buckets=buckets, min_size=100)
        state = tx.init(_params())
        update = jax.jit(lambda g, s: tx.update(g, s))
        failures = []
        for t in range(10):
            grads = _grads(100 + t)
            out, new_state = update(grads, state)
            taken = jax.tree.map(lambda g, r0, r1: np.asarray(g + r0 - r1), grads, state.residual, new_state.residual)
            for i, (u, mine) in enumerate(zip(jax.tree.leaves(out), jax.tree.leaves(taken))):
                if not np.array_equal(np.asarray(u), np.sum(COMM.allgather(mine), axis=0)):
                    failures.append(f"step {t} leaf {i}")
            state = new_state
        return failures

    run_and_agree(check, "error feedback")
