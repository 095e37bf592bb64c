"""The global top-k definitions (SparDL, gTop-k), run for P = 1..8 ranks at once on the
simulated transport, against the plain numpy references of tests/global_topk_reference.py:
the same result and residuals bit for bit, the exact books (result + residuals == inputs), the
bound on the result's entries and the wire volumes. The MPI transports run the same
definitions under mpirun (tests/mpi)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from global_topk_reference import gtopk_reference, spardl_reference

from sparcml_jax import partition_bounds
from sparcml_jax.collectives._plan import GLOBAL_TOPK_ALGORITHMS, definition
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
