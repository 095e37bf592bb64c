"""Multi-rank global top-k allreduce (run under mpirun -n P): every algorithm on both transports
against the plain numpy references of tests/global_topk_reference.py, bit for bit on integer
data; the exact books; the bounds on the result; the bytes each rank sends, against the
simulated transport's count of the same definition; and bad input raising on every rank.

Every rank generates every rank's input (seeded by rank), so each rank checks the whole
reference without gathering the inputs.
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI
from _util import (COMM, GLOBAL_TOPK_ERROR_TRANSPORTS, NPROCS, RANK, REDUCED_GLOBAL_TOPK, TRANSPORTS,
                   check_identical_on_all_ranks, expect_error_everywhere, global_topk_cases, run_and_agree)

from sparcml_jax import GLOBAL_TOPK_ALGORITHMS, SparseStream, global_topk_allreduce
from sparcml_jax.collectives.global_topk import init_oktopk_state
from sparcml_jax.collectives._plan import definition
from sparcml_jax.comm.simulated import SimStream, Simulated

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the references
from global_topk_reference import (balanced_starts, gtopk_reference, initial_oktopk_state,  # noqa: E402
                                   kth_magnitude, oktopk_step_reference, spardl_reference)


def oktopk_first_step(xs, k):
    return oktopk_step_reference(xs, k, initial_oktopk_state(len(xs)))[:3]


REFERENCES = {"spardl": spardl_reference, "gtopk": gtopk_reference, "oktopk": oktopk_first_step}
# (N, k): N = 1001 divides by none of 2..8; k = N is the dense sum; N = 3 is smaller than most P.
CASES = ((1001, 0), (1001, 10), (1001, 1001), (3, 2))
KINDS = ("random", "sparse", "ties")


def accumulators(n: int, kind: str, seed: int) -> list[np.ndarray]:
    out = []
    for r in range(NPROCS):
        rng = np.random.default_rng([seed, r])
        x = (rng.integers(1, 20, n) * rng.choice([-1, 1], n)).astype(np.float32)
        if kind == "sparse":  # most entries zero, unequal supports
            x[rng.random(n) > 0.1 * (r + 1) / NPROCS] = 0.0
        elif kind == "ties":
            x = np.where(rng.random(n) < 0.5, -3.0, 3.0).astype(np.float32)
        out.append(x)
    return out


def simulated_bytes(algorithm: str, transport: str, xs: list[np.ndarray], k: int, state: dict | None = None,
                    tau: int = 128, tau_prime: int = 64, teams: int = 1) -> float:
    """Rank RANK's bytes as the simulated transport counts the definition's (Ok-Topk's: with
    the thresholds and starts of the reference's step, plus its balancing allreduce)."""
    n = xs[0].size
    t = Simulated(NPROCS, n, wire=transport)
    options, balancing = ({"teams": teams} if teams > 1 else {}), 0.0
    if algorithm == "oktopk":
        state = initial_oktopk_state(NPROCS) if state is None else state
        exact = state["step"] % tau == 0
        local = [kth_magnitude(x, k) for x in xs] if exact else state["local"]
        repartition = state["step"] % tau_prime == 0 and NPROCS > 1
        starts = balanced_starts(xs, local) if repartition else state["starts"]
        options = dict(local_threshold=local, global_threshold=state["global"], starts=starts, exact=exact)
        balancing = 2 * (NPROCS - 1) / NPROCS * 8 * (NPROCS - 1) if repartition else 0.0
    definition(algorithm)(t, [SimStream(n, n, None, x.copy()) for x in xs], k=k, **options)
    return float(np.float32(t.sent[RANK]) + np.float32(balancing))


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("algorithm", GLOBAL_TOPK_ALGORITHMS)
def test_global_topk_is_its_reference_with_exact_books(algorithm, transport):
    def body():
        failures = []
        for n, k in global_topk_cases(transport, CASES):
            for seed, kind in enumerate(KINDS):
                label = f"{algorithm}/{transport} N={n} k={k} {kind}"
                xs = accumulators(n, kind, seed=100 * n + seed)
                total, residual, stats = global_topk_allreduce(jnp.asarray(xs[RANK]), k, algorithm=algorithm,
                                                               transport=transport, return_stats=True)
                want_total, want_support, want_residuals = REFERENCES[algorithm](xs, k)
                got = np.asarray(total.to_dense())
                if not np.array_equal(got, want_total):
                    failures.append(f"{label}: total differs from the reference at {np.flatnonzero(got != want_total)[:8]}")
                if not np.array_equal(np.asarray(residual), want_residuals[RANK]):
                    failures.append(f"{label}: residual differs from the reference")
                books = got + COMM.allreduce(np.asarray(residual), op=MPI.SUM)
                if not np.array_equal(books, np.sum(xs, axis=0, dtype=np.float32)):
                    failures.append(f"{label}: total + residuals != inputs")
                bound = min(n, k + NPROCS if algorithm == "spardl" else k)  # (Ok-Topk's first step re-evaluates: k)
                if np.count_nonzero(got) > bound or (int(total.nnz) > bound and int(total.nnz) != n):
                    failures.append(f"{label}: {int(total.nnz)} entries, above the bound {bound}")
                if float(stats.bytes_sent) != simulated_bytes(algorithm, transport, xs, k):
                    failures.append(f"{label}: sent {float(stats.bytes_sent)} bytes, the definition says "
                                    f"{simulated_bytes(algorithm, transport, xs, k)}")
                failures += check_identical_on_all_ranks(total, label)
        return failures

    run_and_agree(body, f"global top-k {algorithm}/{transport}")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_spardl_in_teams_is_its_reference(transport):
    """SparDL's Spar-All-Gather with the smallest and the largest G > 1 that divide P (the
    simulated tests take every G): the reference's result and residuals, exact books, at most
    k + P / G entries, and the definition's bytes."""
    divisors = [g for g in range(2, NPROCS + 1) if NPROCS % g == 0]
    if transport == "mpi4jax" and REDUCED_GLOBAL_TOPK:
        divisors = divisors[:1]

    def body():
        failures = []
        for teams in sorted({divisors[0], divisors[-1]}) if divisors else []:
            for n, k in global_topk_cases(transport, CASES[1:]):
                for seed, kind in enumerate(KINDS[:2]):
                    label = f"spardl teams={teams}/{transport} N={n} k={k} {kind}"
                    xs = accumulators(n, kind, seed=100 * n + seed)
                    total, residual, stats = global_topk_allreduce(jnp.asarray(xs[RANK]), k, teams=teams,
                                                                   transport=transport, return_stats=True)
                    want_total, _, want_residuals = spardl_reference(xs, k, teams)
                    got = np.asarray(total.to_dense())
                    if not np.array_equal(got, want_total) or not np.array_equal(np.asarray(residual),
                                                                                 want_residuals[RANK]):
                        failures.append(f"{label}: differs from the reference")
                    if not np.array_equal(got + COMM.allreduce(np.asarray(residual), op=MPI.SUM), np.sum(xs, axis=0)):
                        failures.append(f"{label}: total + residuals != inputs")
                    if np.count_nonzero(got) > min(n, k + NPROCS // teams):
                        failures.append(f"{label}: {np.count_nonzero(got)} entries, above k + P / G")
                    want_sent = simulated_bytes("spardl", transport, xs, k, teams=teams)
                    if float(stats.bytes_sent) != want_sent:
                        failures.append(f"{label}: sent {float(stats.bytes_sent)} bytes, the definition says {want_sent}")
                    failures += check_identical_on_all_ranks(total, label)
        return failures

    run_and_agree(body, f"spardl in teams ({transport})")


@pytest.mark.parametrize("transport", GLOBAL_TOPK_ERROR_TRANSPORTS)
def test_bad_arguments_raise_on_every_rank(transport):
    x = jnp.ones(64)
    expect_error_everywhere(
        lambda: global_topk_allreduce(x, 65 if RANK == 0 else 8, transport=transport),
        lambda r: "k=65 must lie in" if r == 0 else "rejected its arguments", "k out of range on rank 0")
    if NPROCS > 1:
        expect_error_everywhere(
            lambda: global_topk_allreduce(x if RANK == 0 else x.astype(jnp.int32), 8, transport=transport),
            lambda r: "rejected its arguments" if r == 0 else "x must have dtype float32", "int32 x on ranks > 0")
        expect_error_everywhere(lambda: global_topk_allreduce(x, 8 + RANK % 2, transport=transport),
                                "ranks disagree on k", "different k")
        expect_error_everywhere(lambda: global_topk_allreduce(jnp.ones(64 + RANK % 2), 8, transport=transport),
                                "ranks disagree on size", "different N")
        expect_error_everywhere(
            lambda: global_topk_allreduce(x, 8, algorithm=GLOBAL_TOPK_ALGORITHMS[RANK % 2], transport=transport),
            "ranks disagree on algorithm", "different algorithms")
    run_and_agree(lambda: [] if float(global_topk_allreduce(x, 64, transport=transport)[0].to_dense()[0]) == NPROCS
                  else ["the next call did not sum"], "a call after the errors")


def test_a_stream_is_not_an_accumulator():
    s = SparseStream.from_dense(jnp.ones(8), capacity=8)
    expect_error_everywhere(lambda: global_topk_allreduce(s, 2), "pass stream.to_dense()", "a SparseStream as x")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_error_feedback_inside_jit_keeps_the_books_over_steps(transport):
    """The residual carried from step to step inside a jitted step: after every step the result
    plus the residuals is the sum of every gradient so far."""
    @jax.jit
    def step(grad, residual):
        total, residual = global_topk_allreduce(grad + residual, 5, algorithm="gtopk", transport=transport)
        return total.to_dense(), residual

    def body():
        residual, sent, failures = jnp.zeros(100), np.zeros(100, np.float32), []
        grads = np.zeros(100, np.float32)
        for t in range(3):
            grad = jnp.asarray(np.random.default_rng([t, RANK]).integers(-9, 9, 100).astype(np.float32))
            total, residual = step(grad, residual)
            sent += np.asarray(total)
            grads += COMM.allreduce(np.asarray(grad), op=MPI.SUM)
            books = sent + COMM.allreduce(np.asarray(residual), op=MPI.SUM)
            if not np.array_equal(books, grads):
                failures.append(f"step {t}: sent + residuals != gradients")
        return failures

    run_and_agree(body, f"error feedback in jit ({transport})")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_oktopk_carries_its_state_as_its_reference_does(transport):
    """Ok-Topk over steps with its state: thresholds re-evaluated every third step and carried
    (and moved) in between, regions re-balanced every second; every step is the reference's,
    keeps the books, and stays within its bound: k entries after a re-evaluation, P ceil(2k / P)
    otherwise."""
    tau, tau_prime, n, k = 3, 2, 1001, 10
    if transport == "mpi4jax" and NPROCS > 5:
        pytest.skip("Ok-Topk's steps with state run on mpi4jax at P <= 5 (see REDUCED_GLOBAL_TOPK)")

    def body():
        failures, state, want = [], init_oktopk_state(), initial_oktopk_state(NPROCS)
        residuals = [np.zeros(n, np.float32) for _ in range(NPROCS)]
        for step in range(7):
            grads = accumulators(n, ("random", "sparse")[step % 2], seed=step)
            xs = [g + r for g, r in zip(grads, residuals)]
            label = f"oktopk/{transport} step {step}"
            sent = simulated_bytes("oktopk", transport, xs, k, want, tau, tau_prime)
            total, residual, state, stats = global_topk_allreduce(
                jnp.asarray(xs[RANK]), k, algorithm="oktopk", transport=transport, oktopk_state=state, tau=tau,
                tau_prime=tau_prime, return_stats=True)
            want_total, _, residuals, want = oktopk_step_reference(xs, k, want, tau, tau_prime)
            got = np.asarray(total.to_dense())
            if not np.array_equal(got, want_total) or not np.array_equal(np.asarray(residual), residuals[RANK]):
                failures.append(f"{label}: differs from the reference")
            if not np.array_equal(got + COMM.allreduce(np.asarray(residual), op=MPI.SUM), np.sum(xs, axis=0)):
                failures.append(f"{label}: total + residuals != inputs")
            bound = k if step % tau == 0 else NPROCS * -(-2 * k // NPROCS)
            if int(total.nnz) > bound:
                failures.append(f"{label}: {int(total.nnz)} entries, above the bound {bound}")
            got_state = (int(state.step), np.float32(state.local_threshold), np.float32(state.global_threshold),
                         np.asarray(state.starts).tolist())
            want_state = (want["step"], want["local"][RANK], want["global"], np.asarray(want["starts"]).tolist())
            if got_state != want_state:
                failures.append(f"{label}: state {got_state}, the reference's {want_state}")
            if float(stats.bytes_sent) != sent:
                failures.append(f"{label}: sent {float(stats.bytes_sent)} bytes, the definition says {sent}")
            failures += check_identical_on_all_ranks(total, label)
        return failures

    run_and_agree(body, f"oktopk with state ({transport})")


@pytest.mark.parametrize("transport", GLOBAL_TOPK_ERROR_TRANSPORTS)
def test_oktopk_state_errors_raise_on_every_rank(transport):
    x, state = jnp.ones(64), init_oktopk_state()
    expect_error_everywhere(lambda: global_topk_allreduce(x, 8, algorithm="spardl", oktopk_state=state,
                                                          transport=transport), "oktopk_state is Ok-Topk's",
                            "a state for SparDL")
    expect_error_everywhere(lambda: global_topk_allreduce(x, 8, algorithm="oktopk", tau=0, transport=transport),
                            "tau must be a static int >= 1", "tau = 0")
    expect_error_everywhere(lambda: global_topk_allreduce(x, 8, teams=NPROCS + 1, transport=transport),
                            "must divide the number of ranks", "teams that do not divide P")
    expect_error_everywhere(lambda: global_topk_allreduce(x, 8, algorithm="gtopk", teams=2, transport=transport),
                            "teams is SparDL's", "teams for gTop-k")
    wrong = state._replace(starts=jnp.zeros((NPROCS + 1,), jnp.int32))
    expect_error_everywhere(lambda: global_topk_allreduce(x, 8, algorithm="oktopk", oktopk_state=wrong,
                                                          transport=transport), "oktopk_state.starts must be",
                            "starts of the wrong length")
    if NPROCS > 1:  # ranks at different steps run different programs: the signatures disagree
        skewed = state._replace(step=jnp.int32(RANK % 2))
        expect_error_everywhere(lambda: global_topk_allreduce(x, 8, algorithm="oktopk", oktopk_state=skewed, tau=2,
                                                              transport=transport), "ranks disagree on exact",
                                "ranks at different steps")
