"""The cost model's count of the mpi4jax transport's staging against XLA's own (mpirun -n P).

``staged_elements`` prices the packing, padding and slicing of whole static buffers that the
mpi4jax transport makes XLA do around its MPI calls. Its coefficients must stay what XLA counts
for the compiled program (``cost_analysis()["bytes accessed"] / 4``, the slowest rank's), or the
model drifts from the code. Sizes with and without a remainder (unequal parts are padded),
capacities from sparse to N (where messages turn compact).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from _util import COMM, NPROCS, agree_all
from mpi4py import MPI

from sparcml_jax import sparse_allreduce
from sparcml_jax.collectives.cost_model import staged_elements
from sparcml_jax.stream import SparseStream

SPARCML = ("ssar_recursive_doubling", "ssar_split_allgather")  # (DSAR and dense run on the engine, staging nothing)


def xla_elements(algorithm: str, size: int, capacity: int) -> float:
    stream = SparseStream(jax.ShapeDtypeStruct((capacity,), jnp.int32), jax.ShapeDtypeStruct((capacity,), jnp.float32),
                          jax.ShapeDtypeStruct((), jnp.int32), size)
    program = jax.jit(lambda s: sparse_allreduce(s, algorithm=algorithm, transport="mpi4jax", comm=COMM).values)
    accessed = program.lower(stream).compile().cost_analysis().get("bytes accessed", 0.0)
    return COMM.allreduce(accessed / 4, op=MPI.MAX)


@pytest.mark.environment
@pytest.mark.skipif(NPROCS < 2, reason="one rank stages nothing")
def test_staged_elements_match_xla_cost_analysis():
    failures = []
    # (Compiling is what this costs: 8 ranks on 2 cores take about 3 s per program.)
    for size, density in (((1 << 14) + 3, 0.01), ((1 << 14) + 3, 0.2), ((1 << 14) + 3, 1.0), (1 << 14, 0.01)):
        capacity = max(1, int(size * density))
        for algorithm in SPARCML:
            counted = xla_elements(algorithm, size, capacity)
            modelled = staged_elements(algorithm, size=size, nprocs=NPROCS, capacity=capacity)
            if abs(counted - modelled) > 0.1 * modelled + 64:  # (+ headers and scalars)
                failures.append(f"{algorithm} at N={size}, capacity {capacity}: XLA counts {counted:.0f} "
                                f"elements, the model {modelled}")
    agree_all(failures, "staged elements")
