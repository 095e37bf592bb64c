"""The dense baseline: MPI_Allreduce (mpi4jax, or the native transport's own call, which densifies the
stream straight into the result buffer)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import mpi4jax
from mpi4py import MPI

from sparcml_jax.collectives._plan import Plan, Progress
from sparcml_jax.comm import resolve_comm
from sparcml_jax.stream import VALUE_BYTES, SparseStream


def dense_allreduce(x: jax.Array, *, comm: MPI.Comm | None = None) -> jax.Array:
    """Sum of ``x`` over the ranks of ``comm`` (MPI_Allreduce via mpi4jax); works under ``jit``.

    Example (under ``mpirun -n P``; with one process it is the identity):
      >>> import jax.numpy as jnp
      >>> from mpi4py import MPI
      >>> from sparcml_jax import dense_allreduce
      >>> bool((dense_allreduce(jnp.ones(3)) == MPI.COMM_WORLD.size).all())
      True
    """
    comm = resolve_comm(comm)
    return mpi4jax.allreduce(x, op=MPI.SUM, comm=comm)


def dense_as_stream(s: SparseStream, plan: Plan) -> tuple[SparseStream, Progress]:
    result = plan.transport.allreduce_dense(s, comm=plan.comm)
    p = plan.nprocs
    # Volume of a reduce-scatter + allgather (Rabenseifner / ring), which MPICH uses for large vectors.
    sent = jnp.float32(2 * (p - 1) / p * VALUE_BYTES * s.size)
    return result, Progress.start().after(0, jnp.int32(0), sent, jnp.bool_(True))
