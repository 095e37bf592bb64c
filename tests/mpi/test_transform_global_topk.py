"""allreduce_gradients with a global top-k algorithm on several ranks: every rank holds identical
parameters after every step, and the books balance across ranks (the update is the sum of what
the ranks took from gradient plus residual, exactly, on integer data)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import sparcml_jax
from _util import (COMM, NPROCS, RANK, expect_error_everywhere, one_rank_against_its_peers, run_and_agree,
                   transform_checks)

pytestmark = transform_checks

tree_get = optax.tree_utils.tree_get


def _params():
    return {"w": jnp.zeros((30, 40)), "b": jnp.zeros(40), "v": jnp.zeros(3000)}


def _grads(step: int):
    rng = np.random.default_rng([step, RANK, 17])
    return jax.tree.map(lambda p: jnp.asarray(rng.integers(-4, 5, p.shape).astype(np.float32)), _params())


def _flat(tree):
    return np.concatenate([np.asarray(x).ravel() for x in jax.tree.leaves(tree)])


def held(state):
    """The residual per parameter leaf (the transforms here fuse with min_size=100)."""
    return sparcml_jax.unfuse_leaves(tree_get(state, "residual"), _params(), min_size=100)


def test_identical_parameters_after_every_step():
    def check():
        failures = []
        for options in (dict(algorithm="spardl", density=0.02, min_size=100),
                        dict(algorithm="gtopk", k=60, fuse=False, warmup_steps=1, transport="mpi4jax"),
                        dict(algorithm="oktopk", density=0.02, min_size=100)):
            tx = optax.chain(sparcml_jax.allreduce_gradients(**options), optax.adam(1e-2))
            params, state = _params(), tx.init(_params())

            @jax.jit
            def step(p, s, g):
                u, s = tx.update(g, s, p)
                return optax.apply_updates(p, u), s

            for t in range(4):
                params, state = step(params, state, _grads(t))
                mine = _flat(params)
                if not np.array_equal(mine, COMM.bcast(mine, root=0)):
                    failures.append(f"{options} step {t}: parameters differ from rank 0's")
        return failures

    run_and_agree(check, "identical parameters")


@pytest.mark.parametrize("algorithm,average", [("spardl", False), ("gtopk", True), ("oktopk", False)])
def test_books_balance_across_ranks(algorithm, average):
    """Every step the update is the sum over ranks of (gradient + old residual - new residual),
    divided by P when averaged: what the ranks hold back and what is applied add up to every
    gradient. The result keeps at most k + P entries (Ok-Topk: k on its first step, which
    evaluates its thresholds exactly, 2k + P on the others)."""

    def check():
        failures = []
        tx = sparcml_jax.allreduce_gradients(density=0.03, algorithm=algorithm, min_size=100, average=average)
        state, update = tx.init(_params()), jax.jit(tx.update)
        for t in range(6):
            grads = _grads(100 + t)
            out, new_state = update(grads, state)
            taken = _flat(grads) + _flat(held(state)) - _flat(held(new_state))
            want = np.sum(COMM.allgather(taken), axis=0, dtype=np.float32)
            # The sum is exact; XLA divides by P as a multiplication by 1 / P (within an ulp).
            if not (np.allclose(_flat(out), want / COMM.size, rtol=2e-7, atol=0) if average
                    else np.array_equal(_flat(out), want)):
                failures.append(f"step {t}: the update is not what the ranks took")
            nnz = round(float(tree_get(new_state, "stats").density) * 4200)  # fused: 30*40 + 3000 entries
            k = int(np.ceil(0.03 * 4200))
            bound = (k if t == 0 else 2 * k + COMM.size) if algorithm == "oktopk" else k + COMM.size
            if not 0 < nnz <= bound:
                failures.append(f"step {t}: result of {nnz} entries, above {bound}")
            state = new_state
        return failures

    run_and_agree(check, f"books ({algorithm})")


def test_teams_and_intervals_reach_the_collective():
    """allreduce_gradients(teams=G, ...) sums what global_topk_allreduce(..., teams=G) sums, at the
    largest divisor G of P (SparDL's Spar-All-Gather); Ok-Topk's tau and tau_prime likewise."""

    def check():
        failures = []
        teams = max([1] + [g for g in range(2, COMM.size) if COMM.size % g == 0])
        params = {"v": jnp.zeros(3000)}
        grads = {"v": _grads(7)["v"]}
        for algorithm, options in (("spardl", dict(teams=teams)), ("oktopk", dict(tau=1, tau_prime=1))):
            tx = sparcml_jax.allreduce_gradients(k=40, algorithm=algorithm, average=False, **options)
            out, _ = jax.jit(tx.update)(grads, tx.init(params))
            total, _ = sparcml_jax.global_topk_allreduce(grads["v"], 40, algorithm=algorithm, **options)
            if not np.array_equal(np.asarray(out["v"]), np.asarray(total.to_dense())):
                failures.append(f"{algorithm} {options}: the transform's sum differs from the collective's")
        return failures

    run_and_agree(check, "teams and intervals")


@one_rank_against_its_peers
@pytest.mark.parametrize("algorithm", sparcml_jax.GLOBAL_TOPK_ALGORITHMS)
def test_a_residual_that_misfits_on_one_rank_raises_on_every_rank(algorithm):
    """The residual is checked as the step is traced, before any message: the peers, already in
    the collective, raise too instead of waiting for the rank that failed."""
    bad = RANK == NPROCS - 1
    tx = sparcml_jax.allreduce_gradients(density=0.05, algorithm=algorithm, min_size=100)
    params = _params()
    state = tx.init({**params, "v": jnp.zeros(2000)} if bad else params)
    update = jax.jit(lambda g, s: tx.update(g, s, params))
    expect_error_everywhere(lambda: update(_grads(0), state)[0],
                            "the gradient's fused buffers have shapes" if bad else "another rank rejected its arguments",
                            algorithm)
    sparcml_jax.reset_after_error()

    def next_step():
        mine = _flat(update(_grads(1), tx.init(params))[0])
        return [] if np.array_equal(mine, COMM.bcast(mine)) else ["the next step differs across ranks"]

    run_and_agree(next_step, f"{algorithm}: the next good step")
