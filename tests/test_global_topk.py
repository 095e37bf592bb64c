"""The global top-k definitions (SparDL, gTop-k, Ok-Topk), run for P = 1..8 ranks at once on the
simulated transport, against the plain numpy references of tests/global_topk_reference.py:
the same result and residuals bit for bit, the exact books (result + residuals == inputs), the
bound on the result's entries and the wire volumes. The MPI transports run the same
definitions under mpirun (tests/mpi)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from global_topk_reference import gtopk_reference, oktopk_reference, spardl_reference

from sparcml_jax import partition_bounds
from sparcml_jax.collectives._plan import GLOBAL_TOPK_ALGORITHMS, definition
from sparcml_jax.collectives.oktopk import oktopk
from sparcml_jax.comm.simulated import SimStream, Simulated
from sparcml_jax.stream import dense_threshold

REFERENCES = {"spardl": spardl_reference, "gtopk": gtopk_reference}
SIMULATED = tuple(a for a in GLOBAL_TOPK_ALGORITHMS if a in REFERENCES)


def accumulators(p: int, n: int, kind: str, seed: int) -> list[np.ndarray]:
    """Integer-valued dense inputs (exact in float32 in any order)."""
    out = []
    for r in range(p):
        rng = np.random.default_rng([seed, r])
        x = (rng.integers(1, 20, n) * rng.choice([-1, 1], n)).astype(np.float32)
        if kind == "sparse":  # most entries zero, supports unequal across ranks
            x[rng.random(n) > 0.1 * (r + 1) / p] = 0.0
        elif kind == "zero":
            x[:] = 0.0
        elif kind == "ties":  # every magnitude equal: the lower index decides
            x = np.where(rng.random(n) < 0.5, -3.0, 3.0).astype(np.float32)
        out.append(x)
    return out


def run(algorithm: str, xs: list[np.ndarray], k: int):
    p, n = len(xs), xs[0].size
    t = Simulated(p, n)
    total, residual = definition(algorithm)(t, [SimStream(n, n, None, x.copy()) for x in xs], k=k)
    return t, total, residual


@pytest.mark.parametrize("algorithm", SIMULATED)
@pytest.mark.parametrize("p", range(1, 9))
def test_the_definition_is_the_reference_and_its_books_balance(algorithm, p):
    for n in (1, 5, 64, 1001):
        for kind in ("random", "sparse", "zero", "ties"):
            xs = accumulators(p, n, kind, seed=7 * n + p)
            for k in sorted({0, 1, max(1, n // 100), n // 10, n}):
                label = f"{algorithm} P={p} N={n} {kind} k={k}"
                _, total, residual = run(algorithm, xs, k)
                want_total, want_support, want_residuals = REFERENCES[algorithm](xs, k)
                for r in range(p):
                    np.testing.assert_array_equal(total[r].to_dense(), want_total, err_msg=f"{label} rank {r}")
                    if total[r].dense:  # SparCML's switch, on the count of what was selected
                        assert len(want_support) >= dense_threshold(n), label
                    else:
                        np.testing.assert_array_equal(total[r].idx, want_support, err_msg=label)
                    np.testing.assert_array_equal(residual[r].to_dense(), want_residuals[r], err_msg=f"{label} r{r}")
                books = want_total + np.sum([res.to_dense() for res in residual], axis=0, dtype=np.float32)
                np.testing.assert_array_equal(books, np.sum(xs, axis=0, dtype=np.float32), err_msg=label)
                bound = k + p if algorithm == "spardl" else k
                assert len(want_support) <= min(bound, n), label
                if k == n:
                    np.testing.assert_array_equal(want_total, np.sum(xs, axis=0, dtype=np.float32), err_msg=label)


@pytest.mark.parametrize("p", range(2, 9))
def test_spar_reduce_scatter_sends_p_minus_1_blocks_of_kb_pairs(p):
    """Per rank: (P - 1) blocks of kb pairs in the first phase, its kb pairs to P - 1 ranks in the second."""
    n, k = 4096, 64
    t, total, _ = run("spardl", accumulators(p, n, "random", seed=p), k)
    bounds = partition_bounds(n, p)
    budgets = [math.ceil(k * (bounds[q + 1] - bounds[q]) / n) for q in range(p)]
    for r in range(p):
        sent_blocks = [(r + q) % p for q in range(1, p)]  # every block but its own, once
        want = 8 * sum(budgets[b] for b in sent_blocks) + 8 * (p - 1) * budgets[r]
        assert t.sent[r] == want, (p, r)
    assert total[0].count <= k + p


def test_gtopk_keeps_what_the_published_tree_loses():
    """P = 4, k = 1: rank 0 selects index 1 (4) and drops it at its first merge for rank 1's 6;
    index 1 then wins through ranks 2 and 3 (5 + 5). The published gTop-k zeroes what a rank
    selected at a globally selected index, so rank 0's 4 would vanish; here it is rank 0's
    residual."""
    xs = [np.array(v, np.float32) for v in ([0, 4, 0, 0], [0, 0, 0, 6], [0, 5, 0, 0], [0, 5, 0, 0])]
    _, total, residual = run("gtopk", xs, 1)
    for r in range(4):
        np.testing.assert_array_equal(total[r].to_dense(), [0, 10, 0, 0])
    np.testing.assert_array_equal(residual[0].to_dense(), [0, 4, 0, 6])
    for r in (1, 2, 3):
        np.testing.assert_array_equal(residual[r].to_dense(), [0, 0, 0, 0])


@pytest.mark.parametrize("p", range(1, 9))
def test_oktopk_is_its_reference_for_any_thresholds_and_regions(p):
    """Ok-Topk's definition for thresholds and region starts drawn at random (the estimates
    that a state may carry, good or bad): the reference's result and residuals bit for bit,
    exact books, and the bound: k entries after a re-evaluation, P ceil(2k / P) otherwise."""
    for n in (1, 5, 64, 1001):
        for kind in ("random", "sparse", "zero", "ties"):
            xs = accumulators(p, n, kind, seed=3 * n + p)
            for k in sorted({0, 1, max(1, n // 100), n // 10, n}):
                rng = np.random.default_rng([k, n, p])
                starts = np.sort(rng.integers(0, n + 1, p - 1))
                for exact in (True, False):
                    local = [float(rng.integers(0, 15)) for _ in range(p)]
                    global_threshold = float(rng.integers(0, 40))
                    label = f"P={p} N={n} {kind} k={k} exact={exact}"
                    t = Simulated(p, n)
                    total, residual = oktopk(t, [SimStream(n, n, None, x.copy()) for x in xs], k=k,
                                             local_threshold=local, global_threshold=global_threshold, starts=starts,
                                             exact=exact)
                    want_total, want_support, want_residuals = oktopk_reference(xs, k, local, global_threshold,
                                                                                starts, exact)
                    for r in range(p):
                        np.testing.assert_array_equal(total[r].to_dense(), want_total, err_msg=f"{label} rank {r}")
                        np.testing.assert_array_equal(residual[r].to_dense(), want_residuals[r], err_msg=label)
                    books = want_total + np.sum(want_residuals, axis=0, dtype=np.float32)
                    np.testing.assert_array_equal(books, np.sum(xs, axis=0, dtype=np.float32), err_msg=label)
                    assert len(want_support) <= min(n, k if exact else p * -(-2 * k // p)), label


def test_oktopk_hands_every_region_to_its_owner_once():
    """P = 4, one selected entry per rank in every region: each rank sends the P - 1 regions it
    does not own, one pair each (8 bytes), and the owners keep all of them."""
    p, n = 4, 16
    xs = [np.where(np.arange(n) % 4 == r, 1.0, 0.0).astype(np.float32) * (r + 1) for r in range(p)]
    t = Simulated(p, n)
    total, _ = oktopk(t, [SimStream(n, n, None, x) for x in xs], k=n, local_threshold=[0.5] * p,
                      global_threshold=0.5, starts=[4, 8, 12], exact=False)
    assert t.sent == [8.0 * 3 + 8.0 * 4 * 3] * p  # the reduce-scatter, then its 4 pairs to 3 ranks
    np.testing.assert_array_equal(total[0].to_dense(), np.sum(xs, axis=0))


@pytest.mark.parametrize("p", range(2, 9))
def test_spardl_in_teams_is_its_reference(p):
    """SparDL's Spar-All-Gather with G teams (every G > 1 that divides P): the reference bit for
    bit, exact books, at most k + P / G entries, k = N the dense sum."""
    for teams in [g for g in range(2, p + 1) if p % g == 0]:
        for n in (1, 5, 64, 1001):
            for kind in ("random", "sparse", "zero", "ties"):
                xs = accumulators(p, n, kind, seed=3 * n + p)
                for k in sorted({0, 1, max(1, n // 100), n // 10, n}):
                    label = f"P={p} G={teams} N={n} {kind} k={k}"
                    t = Simulated(p, n)
                    total, residual = definition("spardl")(t, [SimStream(n, n, None, x.copy()) for x in xs], k=k,
                                                           teams=teams)
                    want_total, want_support, want_residuals = spardl_reference(xs, k, teams)
                    for r in range(p):
                        np.testing.assert_array_equal(total[r].to_dense(), want_total, err_msg=f"{label} rank {r}")
                        np.testing.assert_array_equal(residual[r].to_dense(), want_residuals[r], err_msg=label)
                    books = want_total + np.sum(want_residuals, axis=0, dtype=np.float32)
                    np.testing.assert_array_equal(books, np.sum(xs, axis=0, dtype=np.float32), err_msg=label)
                    assert len(want_support) <= min(n, k + p // teams), label
                    if k == n:
                        np.testing.assert_array_equal(want_total, np.sum(xs, axis=0, dtype=np.float32), err_msg=label)
