"""Helpers for the in-rank tests (run under ``mpirun -n P python -m pytest tests/mpi``).

Every rank runs the same tests in the same order. A check never asserts on one rank alone: each
rank computes its verdict, the verdicts are gathered, and every rank fails (or passes) together,
so one failing rank cannot leave its peers blocked in the next collective.
"""

from __future__ import annotations

import math
import traceback
from typing import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

from sparcml_jax import SparseStream

COMM = MPI.COMM_WORLD
RANK = COMM.Get_rank()
NPROCS = COMM.Get_size()
ERRORS = (TypeError, ValueError, RuntimeError)  # argument errors; JaxRuntimeError on a first call, ValueError warm

EXPLICIT = ("dense", "ssar_recursive_doubling", "ssar_split_allgather", "dsar_split_allgather", "sparse_ring")
ALGORITHMS_AND_AUTO = (*EXPLICIT, "auto")
TRANSPORTS = ("native", "mpi4jax")

# Quantized DSAR runs (transport, bits): all at P <= 4, a subset at P = 5 and 8 (compiles there
# take seconds). Shared by test_collectives and test_wire_volume so that they share programs.
QUANT_CASES = ([(t, b) for t in TRANSPORTS for b in (2, 4, 8)] if NPROCS <= 4
               else [("native", 2), ("mpi4jax", 4), ("native", 8)] if NPROCS <= 5
               else [("native", 2), ("mpi4jax", 8)])
QUANT_BUCKET = 100
# At P >= 5 the mpi4jax transport's global top-k programs compile for 10-40 s each on 2 cores.
# Their schedules are comm.static_buffers', which the XLA transport shares and tests/mesh checks
# on 8 devices in full; so at P = 5 and 8 mpi4jax takes one case of each check (P = 3 and 4 are
# its full runs, with N below P at P = 4), SparDL's smallest team only, and Ok-Topk's steps with
# state at P = 5; its error checks (which do not depend on P) run at P <= 3.
GLOBAL_TOPK_ERROR_TRANSPORTS = TRANSPORTS if NPROCS <= 3 else ("native",)
REDUCED_GLOBAL_TOPK = NPROCS >= 5


def global_topk_cases(transport: str, cases: tuple) -> tuple:
    """The (N, k) cases of a global top-k check on ``transport``: all, or at P >= 5 on mpi4jax the
    first with 0 < k < N."""
    if transport != "mpi4jax" or not REDUCED_GLOBAL_TOPK:
        return cases
    return (next(c for c in cases if 0 < c[1] < c[0]),)


# What the transform adds to the collectives (fused buffers, residuals, state, QSGD buckets per
# range with a short last one) does not depend on P beyond what P = 1, 2 and 3 cover; at P = 5 its
# programs took half a minute of the 2-core CI to compile, at P = 8 most of a minute.
# One rank failing alone while its peers wait: P = 2 and 3 cover a pair and an odd count (at 5 and 8
# ranks each case's compiles and the calibration it may meet took most of a minute of CI).
one_rank_against_its_peers = pytest.mark.skipif(not 2 <= NPROCS <= 3,
                                                reason="one rank against its peers runs at P = 2 and 3")
transform_checks = pytest.mark.skipif(NPROCS > 3, reason="the transform's multi-rank checks run at P <= 3")


# ----------------------------------------------------------------------------- agreement


def agree_all(failures: Iterable[str] | str | None, what: str = "") -> None:
    """Fails on every rank if any rank reports a failure; the message lists every rank's failures."""
    if isinstance(failures, str):
        failures = [failures]
    local = list(failures or [])
    everyone = COMM.allgather(local)
    lines = [f"rank {r}: {msg}" for r, msgs in enumerate(everyone) for msg in msgs[:8]]
    total = sum(len(m) for m in everyone)
    if total:
        raise AssertionError(f"{what} failed (reported by {sum(bool(m) for m in everyone)}/{NPROCS} ranks, "
                             f"{total} failures):\n" + "\n".join(lines[:40]))


def run_and_agree(fn: Callable[[], list[str] | None], what: str = "") -> None:
    """Runs ``fn`` (returns a list of failure messages), turning an exception into a failure."""
    try:
        failures = fn() or []
    except Exception:  # noqa: BLE001 - reported to every rank
        failures = [traceback.format_exc(limit=6)]
    agree_all(failures, what)


def expect_error_everywhere(call: Callable[[], object], match: str | Callable[[int], str], what: str) -> None:
    """``call`` must raise (ValueError/RuntimeError) on every rank with a message containing ``match``.

    ``match`` may depend on the rank (a callable of the rank). Agreed collectively before asserting.
    """
    want = match(RANK) if callable(match) else match
    try:
        out = call()
        jax.block_until_ready(out)
        failure = f"no error raised (wanted one containing {want!r})"
    except ERRORS as e:
        failure = None if want.lower() in str(e).lower() else f"{type(e).__name__} without {want!r}: {str(e)[:400]}"
    except Exception as e:  # noqa: BLE001
        failure = f"unexpected {type(e).__name__}: {str(e)[:400]}"
    agree_all(failure, what)


# ----------------------------------------------------------------------------- inputs


def dense_threshold(size: int) -> int:
    """SparCML's switch (delta = 1, 32-bit index and value): dense once 8 nnz >= 4 size."""
    return max(1, math.ceil(size / 2))


def part_bounds(size: int, parts: int, r: int) -> tuple[int, int]:
    """SparCML's split: ranges of size // parts, the last one takes the remainder."""
    width = size // parts
    return r * width, size if r == parts - 1 else (r + 1) * width


def count_for(density: float, size: int) -> int:
    return 0 if density == 0 else min(size, max(1, math.ceil(density * size)))


def make_support(size: int, k: int, kind: str, rank: int, nprocs: int, seed: int) -> np.ndarray:
    """Sorted int32 indices of rank ``rank``'s nonzeros.

    kinds: "random" (independent, k each), "identical" (the same k on every rank), "unequal"
    (independent, rank r keeps k * r / (P - 1): rank 0 empty, the last rank k), "nested" (rank r
    keeps a prefix of one common support, fewer on higher ranks), "disjoint" (round-robin, k each
    when k * P <= size).
    """
    if kind == "identical":
        rng = np.random.default_rng([seed, 7777])
        sel = rng.choice(size, k, replace=False)
    elif kind == "random":
        sel = np.random.default_rng([seed, rank]).choice(size, k, replace=False)
    elif kind == "unequal":
        k_r = k if nprocs == 1 else (k * rank) // (nprocs - 1)
        sel = np.random.default_rng([seed, rank]).choice(size, k_r, replace=False)
    elif kind == "nested":
        common = np.random.default_rng([seed, 4242]).permutation(size)[:k]
        sel = common[: k - (k * rank) // (2 * nprocs)]
    elif kind == "disjoint":
        sel = np.arange(rank, size, nprocs)[:k]
    else:
        raise ValueError(kind)
    return np.sort(np.asarray(sel, np.int64)).astype(np.int32)


def make_values(support: np.ndarray, rank: int, seed: int) -> np.ndarray:
    """Nonzero integers in [-9, 9]: every sum over <= 8 ranks is exact in float32."""
    rng = np.random.default_rng([seed, rank, 99])
    v = rng.integers(1, 10, support.size) * rng.choice([-1, 1], support.size)
    return v.astype(np.float32)


def make_stream(support: np.ndarray, values: np.ndarray, size: int, capacity: int) -> SparseStream:
    """The stream of these pairs (the dense representation when every index is present)."""
    k = support.size
    assert k <= capacity, (k, capacity)
    if k == size:
        support = np.arange(size, dtype=np.int32)
    pad = capacity - k
    idx = np.concatenate([support, np.full(pad, size, np.int32)]).astype(np.int32)
    val = np.concatenate([values, np.zeros(pad, np.float32)]).astype(np.float32)
    return SparseStream(jnp.asarray(idx), jnp.asarray(val), jnp.asarray(k, jnp.int32), size)


def dense_of(support: np.ndarray, values: np.ndarray, size: int) -> np.ndarray:
    x = np.zeros(size, np.float32)
    x[support] = values
    return x


class Inputs:
    """This rank's stream, every rank's supports and the oracle sum (gathered with mpi4py)."""

    def __init__(self, size: int, capacity: int, k: int, kind: str, seed: int):
        self.size, self.capacity, self.k, self.kind = size, capacity, k, kind
        self.support = make_support(size, k, kind, RANK, NPROCS, seed)
        self.values = make_values(self.support, RANK, seed)
        self.stream = make_stream(self.support, self.values, size, capacity)
        self.x = dense_of(self.support, self.values, size)
        gathered = COMM.allgather((self.support, self.x))
        self.supports = [s for s, _ in gathered]
        self.rows = np.stack([x for _, x in gathered])
        self.total = np.sum(self.rows, axis=0, dtype=np.float32)
        self.union = np.unique(np.concatenate(self.supports)) if self.supports else np.zeros(0, np.int32)

    def __repr__(self):
        return f"(N={self.size}, cap={self.capacity}, k={self.k}, {self.kind})"


# ----------------------------------------------------------------------------- expected results


def expected_nnz(algorithm: str, inputs: Inputs, result_capacity: int) -> int:
    """The result's nnz under SparCML's dense switch, decided on actual counts.

    dense and DSAR end dense. SSAR_Recursive_double merges streams, so its result is dense exactly
    when the union of all supports reaches the threshold (and the result capacity can hold N).
    SSAR_Split_allgather and the sparse ring decide per range first (a range whose union reaches
    its own threshold travels as its dense slice, i.e. counts its full length), then on the
    concatenated count.
    """
    n, p = inputs.size, NPROCS
    if algorithm in ("dense", "dsar_split_allgather"):
        return n
    if algorithm == "ssar_recursive_doubling" and p == 1:  # no merge at all: the input passes through
        return inputs.supports[0].size
    union = inputs.union
    if algorithm == "ssar_recursive_doubling":
        count = union.size
    elif algorithm in ("ssar_split_allgather", "sparse_ring"):
        count = 0
        for r in range(p):
            lo, hi = part_bounds(n, p, r)
            u = int(np.count_nonzero((union >= lo) & (union < hi)))
            count += (hi - lo) if hi > lo and u >= dense_threshold(hi - lo) else u
    else:
        raise ValueError(algorithm)
    return n if result_capacity >= n and count >= dense_threshold(n) else count


def stream_arrays(s: SparseStream) -> tuple[np.ndarray, np.ndarray, int]:
    nnz = int(s.nnz)
    return np.asarray(s.indices), np.asarray(s.values), nnz


def check_identical_on_all_ranks(s: SparseStream | None, label: str) -> list[str]:
    """Every rank must hold the same stream (valid part, padding and capacity).

    A collective step that every rank takes, also one whose call failed (``s=None``; its failure
    is already recorded), so the ranks stay in lockstep.
    """
    mine = None
    if s is not None:
        idx, val, nnz = stream_arrays(s)
        mine = (idx.tobytes(), val.tobytes(), nnz, s.capacity)
    everyone = [x for x in COMM.allgather(mine) if x is not None]
    bad = [r for r, other in enumerate(everyone) if other != everyone[0]]
    return [f"{label}: result differs from rank 0's on ranks {bad}"] if bad else []


def check_well_formed(s: SparseStream, label: str) -> list[str]:
    """Sorted unique indices in [0, N), padding (index N, value 0) past nnz, dense form = arange;
    or dense by construction: no indices, N values, nnz == N."""
    idx, val, nnz = stream_arrays(s)
    n = s.size
    if idx.size == 0 and val.size == n:
        return [] if nnz == n else [f"{label}: a stream without indices has nnz={nnz}, not N={n}"]
    out = []
    if not 0 <= nnz <= s.capacity:
        return [f"{label}: nnz={nnz} outside [0, capacity={s.capacity}]"]
    valid = idx[:nnz]
    if nnz == n and not np.array_equal(valid, np.arange(n)):
        out.append(f"{label}: dense result without indices 0..N-1")
    if nnz and (np.any(np.diff(valid) <= 0) or valid[0] < 0 or valid[-1] >= n):
        out.append(f"{label}: indices not strictly increasing in [0, N)")
    if np.any(idx[nnz:] != n) or np.any(val[nnz:] != 0):
        out.append(f"{label}: padding past nnz is not (index N, value 0)")
    return out


# ----------------------------------------------------------------------------- JAX runtime tokens


def poisoned_token_error() -> str | None:
    """The error held by JAX's runtime token of an ordered effect, if any (probing never communicates).

    A program with an ordered effect (every MPI op here) passes a runtime token to the next one.
    When such a program fails asynchronously, its output token holds the error and JAX re-raises
    it when the next ordered program starts, on this rank only: that rank then skips a collective
    its peers enter. Tests probe for this before the next collective and agree on the outcome.
    """
    from sparcml_jax.comm._compat import runtime_token_values

    for token in runtime_token_values():
        try:
            token.block_until_ready()
        except Exception as e:  # noqa: BLE001
            return f"{type(e).__name__}: {str(e)[:200]}"
    return None


def reset_runtime_tokens() -> None:
    """Drops JAX's (possibly failed) runtime tokens: test isolation after a poisoned token."""
    from sparcml_jax.comm._compat import clear_runtime_tokens

    try:
        jax.effects_barrier()
    except Exception:  # noqa: BLE001 - the stale error itself
        pass
    clear_runtime_tokens()


def agree_on_poisoned_tokens() -> list[str]:
    """Every rank's poisoned-token error (empty when none): gathered, so every rank sees the same."""
    everyone = COMM.allgather(poisoned_token_error())
    return [f"rank {r}: {e}" for r, e in enumerate(everyone) if e is not None]
