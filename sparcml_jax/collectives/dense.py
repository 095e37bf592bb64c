"""The dense baseline: MPI_Allreduce (mpi4jax's, or the native transport's own call, which
densifies the stream straight into the result buffer)."""

from __future__ import annotations

import jax
import mpi4jax
from mpi4py import MPI

from sparcml_jax.comm import S, Transport, resolve_comm


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


def dense(t: Transport[S], s: S) -> S:
    return t.allreduce(s)
