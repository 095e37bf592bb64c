"""The dense baseline: MPI_Allreduce of a vector via mpi4jax (:func:`dense_allreduce`), and the
dense algorithm of :func:`sparcml_jax.sparse_allreduce`, which the engine runs on both MPI
transports (from the caller's buffer for a dense stream, else densified into the result)."""

from __future__ import annotations

from typing import Hashable

import jax
import mpi4jax
from mpi4py import MPI

from sparcml_jax.collectives.dsar_split_allgather import dsar_split_allgather
from sparcml_jax.comm import S, Transport, resolve_comm


def dense_allreduce(x: jax.Array, *, comm: MPI.Comm | None = None, axis_name: Hashable | None = None) -> jax.Array:
    """Sum of ``x`` over the ranks of ``comm`` (MPI_Allreduce via mpi4jax); works under ``jit``.

    With ``axis_name`` instead, inside ``jax.shard_map`` (or ``jax.pmap``): ``jax.lax.psum``
    over that mesh axis.

    Example (under ``mpirun -n P``; with one process it is the identity):
      >>> import jax.numpy as jnp
      >>> from mpi4py import MPI
      >>> from sparcml_jax import dense_allreduce
      >>> bool((dense_allreduce(jnp.ones(3)) == MPI.COMM_WORLD.size).all())
      True
    """
    if axis_name is not None:
        from sparcml_jax.collectives.on_axis import axis_plan

        axis_plan(axis_name, comm, None, 1.0)  # raises for comm given too, or for an axis not bound here
        return jax.lax.psum(x, axis_name)
    comm = resolve_comm(comm)
    return mpi4jax.allreduce(x, op=MPI.SUM, comm=comm)


def dense(t: Transport[S], s: S) -> S:
    if t.value_bits != 32:  # MPI cannot sum bfloat16: DSAR's two dense phases, whose sums stay float32
        return dsar_split_allgather(t, s)
    return t.allreduce(s)
