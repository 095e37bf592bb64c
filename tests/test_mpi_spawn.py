"""Runs the multi-rank tests (tests/mpi) under ``mpirun -n P`` for P = 1, 2, 3, 4, 5, 8.

One mpirun per P runs every file of tests/mpi (at P = 4 the algorithms' exactness) in one process per rank, so the files share their
compiled programs (compilation dominates: 8 ranks on 2 cores compile slowly). Each spawn has a
timeout, so a deadlock fails the test instead of hanging CI. Inside the ranks every check is
agreed collectively, so all ranks pass or fail the same tests and a failure cannot desynchronize
the ranks; the run therefore continues past failures (up to a limit) to report them all.
"""

from __future__ import annotations

import re

import pytest
from mpi_spawn import run_pytest_under_mpirun

from sparcml_jax import CostModel
from sparcml_jax.collectives.auto import COST_MODEL_ENV

MPI_TESTS = "tests/mpi"
# Seconds: generous bounds for a 2-core machine, where compilation dominates (8 ranks compile
# slowly); margin for load.
TIMEOUTS = {1: 120, 2: 240, 3: 300, 4: 300, 5: 360, 8: 600}


# At P = 4 (a power of two like 2 and 8) the exactness of every algorithm on both transports and
# their bytes on the wire; the non-blocking engine at P = 1, 2, 3, 5, 8; the errors and the
# transform at P = 1, 2, 3 (tests/mpi/_util.py says why).
FILES = {4: "tests/mpi/test_collectives.py tests/mpi/test_wire_volume.py tests/mpi/test_global_topk.py"}
# From P = 5 ``auto`` takes a model given: calibrating, which P = 2, 3 and 4 run as a user's first
# call does, took 8 s at 5 ranks on 2 cores and 13 s at 8. Every choice it can make is exact.
GIVEN_MODEL_FROM = 5


@pytest.mark.parametrize("nprocs", sorted(TIMEOUTS))
def test_mpi_ranks(nprocs, tmp_path):
    env = None
    if nprocs >= GIVEN_MODEL_FROM:
        model = tmp_path / "cost_model.json"
        CostModel(alpha=2e-6, beta=1e-10, dense_alpha=5e-6, dense_beta=3e-10, pair_cost=1e-9,
                  element_cost=3e-10).save(str(model))
        env = {COST_MODEL_ENV: str(model)}
    run_pytest_under_mpirun(nprocs, FILES.get(nprocs, MPI_TESTS), timeout=TIMEOUTS[nprocs],
                            extra=["--maxfail=20", "-rfEX", "-W", "ignore::DeprecationWarning"], env=env)


@pytest.mark.environment
@pytest.mark.parametrize("nprocs", [2, 4])
def test_mpi_ranks_environment(nprocs):
    """The multi-rank checks of this machine's toolchain (tests/mpi, marked environment)."""
    run_pytest_under_mpirun(nprocs, MPI_TESTS, timeout=TIMEOUTS[nprocs], extra=["-m", "environment", "-rfEX"])


# ----------------------------------------------------------------------------- divergence before agreement
#
# Ranks that diverge before they agree on the static choices (a local argument error, a cached
# program on one rank, calibration for "auto" on one rank) must all raise, not block. A hang here
# would stop every other test of tests/mpi, so each case is a tiny program under its own mpirun
# with a short timeout; every rank must raise a clear error and a following collective complete.

_PRELUDE = """
import jax, jax.numpy as jnp
from mpi4py import MPI
import sparcml_jax as sj
comm = MPI.COMM_WORLD
rank = comm.rank
s = sj.SparseStream.from_dense(jnp.zeros(16).at[rank].set(1.0), capacity=4)
"""

_EPILOGUE = """
try:
    diverge()
    outcome = "no error"
except (ValueError, RuntimeError) as e:
    outcome = "raised: " + str(e).replace(chr(10), " ")[:300]
outcomes = comm.allgather(outcome)  # completes only if no rank is left blocked
print(f"RANK {rank} OUTCOMES {outcomes}", flush=True)
"""

DIVERGENCE = {
    # rank 0 fails a Python-level argument check (raised before any agreement); rank 1 is valid and
    # waits in the agreement forever. sparse_allreduce validates algorithm / transport /
    # quantize_bits / key locally and raises at once (collectives/__init__.py, before _compiled(...)
    # runs agree()), although agree() already accepts a local_error to raise on every rank.
    "argument error on one rank": """
def diverge():
    sj.sparse_allreduce(s, algorithm="ssar_recursive_halving" if rank == 0 else "ssar_recursive_doubling")
""",
    # Both ranks compiled capacity 4; then rank 1 passes capacity 5. The agreement runs only when a
    # signature is traced (collectives/__init__.py, _compiled.run -> _agree_on), so rank 0 (jit cache
    # hit) starts the exchange while rank 1 waits in the agreement on the side communicator.
    "cached signature on one rank": """
sj.sparse_allreduce(s, algorithm="ssar_recursive_doubling")
def diverge():
    other = sj.SparseStream.from_dense(jnp.zeros(16).at[rank].set(1.0), capacity=5)
    sj.sparse_allreduce(s if rank == 0 else other, algorithm="ssar_recursive_doubling")
""",
    # rank 0 asks for "auto" in a fresh process: sparse_allreduce calibrates the cost model
    # (ping-pong on the side communicator) BEFORE the agreement, while rank 1 is already in it.
    "auto on one rank before calibration": """
def diverge():
    sj.sparse_allreduce(s, algorithm="auto" if rank == 0 else "ssar_recursive_doubling")
""",
}


@pytest.mark.parametrize("scenario", list(DIVERGENCE))
def test_divergence_before_agreement_raises_on_every_rank(scenario):
    from mpi_spawn import run_under_mpirun

    code = _PRELUDE + DIVERGENCE[scenario] + _EPILOGUE
    result = run_under_mpirun(2, ["-c", code], timeout=10)  # about 1.5 s when nothing hangs
    # Ranks print concurrently, so lines can run together: find the records, not the lines.
    lines = re.findall(r"RANK \d+ OUTCOMES \[.*?\]", result.stdout)
    assert result.returncode == 0 and len(lines) == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert lines[0].count("raised: ") == 2, f"every rank must raise a clear error: {lines[0]}"


# ----------------------------------------------------------------------------- exit with a reduction in flight

_IN_FLIGHT = _PRELUDE + """
import os
sj.sparse_allreduce_wait(sj.sparse_allreduce_start(s, algorithm="ssar_split_allgather"))
if rank == 0 or os.environ["EVERY_RANK_STARTS"] == "1":
    handle = sj.sparse_allreduce_start(s, algorithm="ssar_split_allgather")
print(f"RANK {rank} EXITS", flush=True)
"""


def test_exit_with_reductions_in_flight_completes_them():
    """Every rank started a reduction and nobody waited: the engines finish it, the exit is clean."""
    from mpi_spawn import run_under_mpirun

    result = run_under_mpirun(2, ["-c", _IN_FLIGHT], timeout=30, env={"EVERY_RANK_STARTS": "1"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stdout.count("EXITS") == 2


def test_exit_with_a_reduction_no_peer_started_aborts_instead_of_hanging():
    """An erroneous program: rank 0 starts a reduction that rank 1 never starts. Exit on rank 0
    waits SPARCML_JAX_EXIT_TIMEOUT seconds for it, then aborts the job with a message."""
    from mpi_spawn import run_under_mpirun

    result = run_under_mpirun(2, ["-c", _IN_FLIGHT], timeout=30,
                              env={"EVERY_RANK_STARTS": "0", "SPARCML_JAX_EXIT_TIMEOUT": "2"})
    assert result.returncode != 0
    assert "still in flight at exit" in result.stderr, result.stderr[-2000:]
