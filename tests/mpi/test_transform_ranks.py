"""The optax transformation on several ranks: every rank holds identical parameters after every
step, exact mode matches a dense allreduce (also for SparseStream gradient leaves, the sparse
training loop of sparcml_jax.lazy), and the error-feedback invariant holds per rank."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import sparcml_jax
from _util import (COMM, NPROCS, RANK, expect_error_everywhere, one_rank_against_its_peers, run_and_agree,
                   transform_checks)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the references
from quantized_dsar_reference import quantized_dsar_reference, split_phase_error  # noqa: E402

pytestmark = transform_checks


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


@pytest.mark.parametrize("options", [dict(), dict(transport="mpi4jax"), dict(capacity=2000), dict(buckets=2)])
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


@pytest.mark.parametrize("options", [
    dict(density=0.02, min_size=100), dict(average=False), dict(k=50, quantize_bits=4, algorithm="dsar_split_allgather"),
    dict(density=0.05, value_dtype=jnp.bfloat16), dict(density=0.05, warmup_steps=1, algorithm="sparse_ring")])
def test_unordered_step_takes_no_effect_and_equals_the_ordered_one(options):
    """``ordered=False``: the jitted step carries no JAX effect (JAX's C++ dispatch path), and its
    parameters equal the ordered step's bit for bit after every step, on every rank; the exact
    mode's sum of integers is np.sum's. Between steps, an eager mpi4jax allreduce (a program on
    the ordered effect, not waited for) must run after the step dispatched before it, as a CPU
    device runs programs in dispatch order."""
    import mpi4jax
    from mpi4py import MPI

    def check():
        failures, finals = [], {}
        for ordered in (True, False):
            tx = optax.chain(sparcml_jax.allreduce_gradients(ordered=ordered, **options), optax.adam(1e-2))
            params, state = _params(), tx.init(_params())

            @jax.jit
            def step(p, s, g):
                u, s = tx.update(g, s, p)
                return optax.apply_updates(p, u), s, u

            effects = jax.make_jaxpr(step)(params, state, _grads(0)).effects
            if not ordered and effects:
                failures.append(f"the unordered step carries effects {effects}")
            for t in range(4):
                grads = _grads(t) if "density" in options or "k" in options else jax.tree.map(
                    lambda g: jnp.where(jnp.abs(g) > 2, g, 0.0), _grads(t))
                params, state, updates = step(params, state, grads)
                total = mpi4jax.allreduce(jnp.float32(t), op=MPI.SUM, comm=COMM)
                failures += _identical_everywhere(params, f"ordered={ordered}, step {t}")
                if float(total) != t * NPROCS:
                    failures.append(f"the eager allreduce after step {t} gave {float(total)}")
                if options == dict(average=False) and t == 0 and not ordered:  # the exact mode, no Adam yet
                    want = np.sum(COMM.allgather(np.asarray(grads["v"])), axis=0)
                    state_free = sparcml_jax.allreduce_gradients(ordered=False, **options)
                    got, _ = jax.jit(state_free.update)(grads, state_free.init(_params()))
                    if not np.array_equal(np.asarray(got["v"]), want):
                        failures.append("the unordered exact mode differs from np.sum")
            finals[ordered] = np.concatenate([np.asarray(x).ravel() for x in jax.tree.leaves(params)])
        if not np.array_equal(finals[True], finals[False]):
            failures.append("the unordered step's parameters differ from the ordered step's")
        return failures

    run_and_agree(check, f"ordered=False {options}")


@pytest.mark.parametrize("options, calls", [
    (dict(), 1), (dict(density=0.05), 1), (dict(density=0.05, value_dtype=jnp.bfloat16), 1),
    (dict(density=0.05, quantize_bits=4), 1), (dict(density=0.05, warmup_steps=1), 1), (dict(warmup_steps=1), 1),
    (dict(capacity=100), 4)])
def test_small_leaves_ride_in_the_fused_buffers_collective(options, calls):
    """The small leaves ("b", 40 entries) travel in the first fused buffer's collective, whole: the
    step's program makes one MPI call, and their sum is exact, also beside top-k. With the exact
    mode's ``capacity`` (a cond of the dense allreduce and the sparse one, after an agreement on
    the counts) they take an allreduce of their own."""
    from sparcml_jax.bench.train import mpi_calls

    def check():
        tx = sparcml_jax.allreduce_gradients(average=False, **options)
        state = tx.init(_params())
        update = jax.jit(tx.update)
        failures = []
        made = mpi_calls(update.lower(_grads(0), state).as_text())
        if COMM.size > 1 and made != calls:
            failures.append(f"{made} MPI calls in the step, not {calls}")
        for t in range(3):
            out, state = update(_grads(t), state)
            if not np.array_equal(np.asarray(out["b"]), np.sum(COMM.allgather(np.asarray(_grads(t)["b"])), axis=0)):
                failures.append(f"step {t}: the small leaf's sum differs from np.sum")
        return failures

    run_and_agree(check, f"small leaves {options}")


@pytest.mark.parametrize("transport", ["native", "mpi4jax"])
def test_stream_gradients_are_summed_exactly_and_applied_lazily(transport):
    """Coalesced lookups (unequal counts, rank 0 empty at step 0, repeats, padding), integer valued:
    the reduced stream is np.sum of every rank's dense gradient, and a lazy adagrad step on it
    gives the parameters of optax.adagrad on the dense sum."""
    size = 3000

    def check():
        failures = []
        tx = optax.chain(sparcml_jax.allreduce_gradients(transport=transport, average=False),
                         sparcml_jax.lazy(optax.adagrad(0.1)))
        dense_tx = optax.adagrad(0.1)
        params = {"w": jnp.zeros(size), "b": jnp.zeros(4)}
        state, dense_params, dense_state = tx.init(params), params, dense_tx.init(params)
        step = jax.jit(lambda p, s, g: tx.update(g, s, p))
        reducer = sparcml_jax.allreduce_gradients(transport=transport, average=False)
        step_sum = jax.jit(lambda p, s, g: reducer.update(g, s[0], p)[0]["w"])
        for t in range(4):
            rng = np.random.default_rng([t, RANK])
            pairs = 0 if (t == 0 and RANK == 0) else int(rng.integers(1, 60)) * (RANK + 1)
            ids = rng.integers(0, size + 1, (8, 40)).astype(np.int32)  # size: padding
            ids.ravel()[pairs:] = size
            vals = rng.integers(-3, 4, ids.shape).astype(np.float32)
            grads = {"w": sparcml_jax.coalesce(ids, vals, size=size), "b": jnp.full(4, float(RANK))}
            state_before = state
            updates, state = step(params, state, grads)
            mine = np.zeros(size, np.float32)
            np.add.at(mine, ids[ids < size], vals[ids < size])
            total = np.sum(COMM.allgather(mine), axis=0)
            reduced = step_sum(params, state_before, grads)
            if not np.array_equal(np.asarray(reduced.to_dense()), total):
                failures.append(f"step {t}: reduced stream differs from np.sum")
            params = jax.jit(sparcml_jax.apply_updates)(params, updates)
            dense_updates, dense_state = dense_tx.update(
                {"w": jnp.asarray(total), "b": jnp.full(4, COMM.size * (COMM.size - 1) / 2)}, dense_state)
            dense_params = optax.apply_updates(dense_params, dense_updates)
            if not np.allclose(np.asarray(params["w"]), np.asarray(dense_params["w"]), rtol=1e-6, atol=1e-7):
                failures.append(f"step {t}: lazy adagrad differs from optax.adagrad on the dense sum")
            failures += _identical_everywhere(params, f"step {t}")
        return failures

    run_and_agree(check, "stream gradients")


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
            before, after = (sparcml_jax.unfuse_leaves(optax.tree_utils.tree_get(s, "residual"), _params(),
                                                       min_size=100, buckets=buckets) for s in (state, new_state))
            taken = jax.tree.map(lambda g, r0, r1: np.asarray(g + r0 - r1), grads, before, after)
            for i, (u, mine) in enumerate(zip(jax.tree.leaves(out), jax.tree.leaves(taken))):
                if not np.array_equal(np.asarray(u), np.sum(COMM.allgather(mine), axis=0)):
                    failures.append(f"step {t} leaf {i}")
            state = new_state
        return failures

    run_and_agree(check, "error feedback")


def test_custom_sparsifier_and_error_feedback_with_a_reduction_of_your_own():
    """The library's error feedback around a sparsifier of your own (the k largest values, not
    magnitudes), followed by a reduction of your own (densify, then mpi4jax's allreduce), against
    the same steps computed by hand in numpy for every rank."""
    import mpi4jax
    from mpi4py import MPI

    k, size, steps = 7, 50, 4

    def largest_values(v, k, key):
        del key
        chosen = jnp.sort(jax.lax.top_k(v, k)[1]).astype(jnp.int32)
        return sparcml_jax.gather(v, chosen, jnp.int32(k))

    def psum_dense():
        def update(updates, state, params=None):
            dense = jax.tree.map(lambda s, p: s.to_dense().reshape(p.shape), updates, params,
                                 is_leaf=lambda x: isinstance(x, sparcml_jax.SparseStream))
            return jax.tree.map(lambda x: mpi4jax.allreduce(x, op=MPI.SUM, comm=COMM), dense), state
        return optax.GradientTransformation(lambda params: optax.EmptyState(), update)

    def grads_of(step, rank):
        return np.random.default_rng([step, rank, 3]).standard_normal(size).astype(np.float32)

    def check():
        tx = optax.chain(sparcml_jax.error_feedback(sparcml_jax.sparsify(largest_values, k=k)), psum_dense())
        params = {"w": jnp.zeros(size)}
        state = tx.init(params)
        update = jax.jit(tx.update)
        residuals = [np.zeros(size, np.float32) for _ in range(COMM.size)]
        failures = []
        for t in range(steps):
            out, state = update({"w": jnp.asarray(grads_of(t, RANK))}, state, params)
            want = np.zeros(size, np.float64)
            for r in range(COMM.size):
                a = grads_of(t, r) + residuals[r]
                sent = np.zeros(size, np.float32)
                top = np.argsort(a)[-k:]
                sent[top] = a[top]
                residuals[r] = a - sent
                want += sent
            if not np.allclose(np.asarray(out["w"]), want, rtol=1e-6, atol=1e-6):
                failures.append(f"step {t}: the sum differs from the hand-computed one")
            if not np.array_equal(np.asarray(state[0].residual["w"]), residuals[RANK]):
                failures.append(f"step {t}: this rank's residual differs from the hand-computed one")
        return failures

    run_and_agree(check, "custom stages")


def test_quantize_feedback_over_steps_is_ef_sgd():
    """allreduce_gradients(quantize_bits=4, quantize_feedback=True) on a dense gradient, step by
    step against the reference: each rank sends v = g + e through quantized DSAR (both phases
    coded) and keeps e = what its split phase lost; sums and errors bit for bit."""
    size, steps, bucket = 3001, 4, 256

    def grads_of(step, rank):
        return np.random.default_rng([step, rank, 5]).standard_normal(size).astype(np.float32)

    def check():
        tx = sparcml_jax.allreduce_gradients(quantize_bits=4, quantize_feedback=True, bucket_size=bucket,
                                             average=False, algorithm="dsar_split_allgather", seed=3)
        params = {"w": jnp.zeros(size)}
        state = tx.init(params)
        update = jax.jit(tx.update)
        errors = np.zeros((COMM.size, size), np.float32)
        key = jax.random.key(3)  # the reducer's key, as its state draws one per step and buffer
        failures = []
        for t in range(steps):
            key, step_key = jax.random.split(key)
            call_key = jax.random.fold_in(step_key, 0)
            sent = np.stack([grads_of(t, r) for r in range(COMM.size)]) + errors
            want = quantized_dsar_reference(sent, call_key, bits=4, bucket=bucket)
            errors = np.stack([split_phase_error(sent, r, call_key, bits=4, bucket=bucket) for r in range(COMM.size)])
            out, state = update({"w": jnp.asarray(grads_of(t, RANK))}, state, params)
            if not np.array_equal(np.asarray(out["w"]).view(np.uint32), want.view(np.uint32)):
                failures.append(f"step {t}: the sum differs from the reference")
            kept = optax.tree_utils.tree_get(state, "quantization_error")[0]
            if not np.array_equal(np.asarray(kept).view(np.uint32), errors[RANK].view(np.uint32)):
                failures.append(f"step {t}: this rank's quantization error differs from the reference")
        return failures

    run_and_agree(check, "quantize_feedback over steps")


@pytest.mark.parametrize("options", [dict(density=0.05), dict(), dict(algorithm="ssar_recursive_doubling")])
def test_bfloat16_values_on_the_wire_sum_small_integers_exactly(options):
    """allreduce_gradients(value_dtype=jnp.bfloat16): gradients of small integers (which bfloat16
    holds, as every partial sum of them) give the float32 run's updates exactly, in half the
    bytes per value."""
    size = 2048

    def grads_of(step):
        return np.random.default_rng([step, RANK, 9]).integers(-4, 5, size).astype(np.float32)

    def check():
        failures = []
        params = {"w": jnp.zeros(size)}
        runs = {}
        for value_dtype in (None, jnp.bfloat16):
            tx = sparcml_jax.allreduce_gradients(value_dtype=value_dtype, average=False, **options)
            state, update, outs = tx.init(params), jax.jit(tx.update), []
            for t in range(3):
                out, state = update({"w": jnp.asarray(grads_of(t))}, state, params)
                outs.append(np.asarray(out["w"]))
            runs[value_dtype] = (outs, float(optax.tree_utils.tree_get(state, "stats").bytes_sent))
        if not all(np.array_equal(a, b) for a, b in zip(runs[None][0], runs[jnp.bfloat16][0])):
            failures.append(f"{options}: bfloat16 updates differ from float32 ones on small integers")
        if COMM.size > 1 and not runs[jnp.bfloat16][1] < runs[None][1]:
            failures.append(f"{options}: bfloat16 sent {runs[jnp.bfloat16][1]} bytes, float32 {runs[None][1]}")
        return failures

    run_and_agree(check, f"bfloat16 wire {options}")


@pytest.mark.parametrize("options", [dict(), dict(value_dtype=jnp.bfloat16), dict(transport="mpi4jax"),
                                     dict(density=0.05), dict(density=0.05, buckets=2)])
def test_bfloat16_leaves_give_the_float32_updates_rounded(options):
    """A bfloat16 gradient (fused into bfloat16 buffers, which the native engine widens and sums in
    float32) gives the updates of the same gradient as float32 leaves, each rounded once to
    bfloat16, bit for bit: the mean too, on fractional values."""

    def check():
        failures = []
        for average in (False, True):
            runs = {}
            for dtype in (jnp.float32, jnp.bfloat16):
                params = jax.tree.map(lambda p: p.astype(dtype), _params())
                tx = sparcml_jax.allreduce_gradients(average=average, min_size=100, **options)
                state, update, outs = tx.init(params), jax.jit(tx.update), []
                for t in range(2):
                    rng = np.random.default_rng([t, RANK, 5])
                    grads = jax.tree.map(lambda p: jnp.asarray(
                        (rng.standard_normal(p.shape) * (rng.random(p.shape) < 0.3)).astype(np.float32)
                    ).astype(jnp.bfloat16).astype(dtype), params)
                    out, state = update(grads, state, params)
                    outs.append(out)
                runs[dtype] = outs
            for t, (wide, narrow) in enumerate(zip(runs[jnp.float32], runs[jnp.bfloat16])):
                for name in wide:
                    want = np.asarray(wide[name].astype(jnp.bfloat16)).view(np.uint16)
                    got = np.asarray(narrow[name])
                    if got.dtype != jnp.bfloat16:
                        failures.append(f"average={average} step {t} {name}: {got.dtype} updates of bfloat16 leaves")
                    elif not np.array_equal(got.view(np.uint16), want):
                        failures.append(f"average={average} step {t} {name}: bfloat16 leaves give "
                                        f"{np.count_nonzero(got.view(np.uint16) != want)} entries other than the "
                                        "float32 updates rounded")
        return failures

    run_and_agree(check, f"bfloat16 leaves {options}")


# A rank whose update does not fit (its state, its gradient) fails as it traces the step, before
# any message; its peers, already in the step's collective, must raise too rather than wait.
MISFIT_RESIDUAL = "the gradient's fused buffers have shapes"
ONE_RANK_MISFITS = {
    "residual of other parameters": (dict(density=0.03, min_size=100), "state", MISFIT_RESIDUAL),
    "mpi4jax transport": (dict(density=0.03, min_size=100, transport="mpi4jax"), "state", MISFIT_RESIDUAL),
    "exact mode, gradient of other parameters": (dict(), "gradient", "its parameter has shape"),
}


@one_rank_against_its_peers
@pytest.mark.parametrize("case", list(ONE_RANK_MISFITS))
def test_an_update_that_misfits_on_one_rank_raises_on_every_rank(case):
    options, what, message = ONE_RANK_MISFITS[case]
    bad = RANK == NPROCS - 1
    tx = sparcml_jax.allreduce_gradients(**options)
    params = _params()
    other = {**params, "v": jnp.zeros(2000)}
    state = tx.init(other if bad and what == "state" else params)
    grads = other if bad and what == "gradient" else _grads(0)
    update = jax.jit(lambda g, s: tx.update(g, s, params))
    expect_error_everywhere(lambda: update(grads, state)[0],
                            message if bad else "another rank rejected its arguments", case)
    sparcml_jax.reset_after_error()
    good = tx.init(params)
    run_and_agree(lambda: _identical_everywhere(update(_grads(1), good)[0], "the next good step"), case)
