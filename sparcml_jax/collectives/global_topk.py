"""The global top-k allreduce: a result of about k entries whatever P is, the rest returned to
the ranks' residuals (SparDL, arXiv 2304.00737; gTop-k, Shi et al. 2019).

SparCML's sparse allreduce sums every rank's top k exactly, so its result grows towards P k and
turns dense as P grows (SparDL's "sparse gradient accumulation dilemma"). These algorithms
re-select inside the collective and keep the books exact: what they drop goes to a residual.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

from sparcml_jax.collectives._plan import GLOBAL_TOPK_ALGORITHMS, Plan, definition
from sparcml_jax.collectives.validate import call_and_recover, reject_everywhere
from sparcml_jax.comm import check_transport, native, resolve_comm
from sparcml_jax.comm.mpi4jax_transport import Mpi4jaxTransport
from sparcml_jax.kernels._common import check_vector
from sparcml_jax.stream import SparseStream, dense_stream, dense_threshold


class GlobalTopkStats(NamedTuple):
    """What one global top-k allreduce did on this rank (a pytree of scalars).

    Attributes:
      algorithm: int32 index into ``GLOBAL_TOPK_ALGORITHMS``.
      bytes_sent: float32 bytes this rank sent (as :class:`AllreduceStats` counts them).
      result_nnz: int32 entries of the result (``size`` when dense).
      returned: float32 ``sum |residual|`` of this rank: the mass left for its next step.
    """

    algorithm: jax.Array
    bytes_sent: jax.Array
    result_nnz: jax.Array
    returned: jax.Array


def global_topk_allreduce(
    x: jax.Array,
    k: int,
    *,
    algorithm: str = "spardl",
    comm: MPI.Comm | None = None,
    transport: str = "native",
    delta: float = 1.0,
    return_stats: bool = False,
):
    r"""About the ``k`` largest entries of the sum of every rank's ``x``, and this rank's residual.

    With :math:`x_r` this rank's accumulated gradient (gradient plus residual), the result
    ``total`` (a :class:`SparseStream`, identical on every rank) and each rank's dense
    ``residual`` keep exact books:

    .. math::  \mathrm{total} + \sum_r \mathrm{residual}_r = \sum_r x_r

    (bit for bit on integer-valued data), so error feedback loses nothing. ``k = size`` gives
    the dense sum and zero residuals.

    - ``"spardl"`` (SparDL §4): Spar-Reduce-Scatter (each rank sends P - 1 blocks of about k / P
      pairs, re-selected before each send), an allgather of the owned blocks, and global
      residual collection: a rank's residual is its own ``x`` except where the result is
      nonzero, where it is what the rank held there and did not pass on. At most k + P entries.
    - ``"gtopk"`` (gTop-k): a binomial tree of merges that keeps the top k of each, then a
      broadcast; every value dropped at a merge stays in the residual of the rank that dropped
      it (the published algorithm loses it at P >= 4). At most k entries.

    Args:
      x: this rank's float32[size] accumulator; every rank passes the same size.
      k: static int in ``[0, size]``: the size of the global result.
      algorithm: one of ``GLOBAL_TOPK_ALGORITHMS``.
      comm: mpi4py communicator; ``None`` is mpi4jax's default (a clone of COMM_WORLD).
      transport: ``"native"`` (only valid entries travel) or ``"mpi4jax"`` (static buffers).
      delta: SparCML's dense switch for the result (dense once ``8 nnz >= delta 4 size``).
      return_stats: also return :class:`GlobalTopkStats`.

    Returns:
      ``(total, residual)``, or ``(total, residual, stats)``.

    Example (under ``mpirun -n P``):
      >>> import jax.numpy as jnp
      >>> import numpy as np
      >>> from mpi4py import MPI
      >>> from sparcml_jax import global_topk_allreduce
      >>> P = MPI.COMM_WORLD.size
      >>> total, residual = global_topk_allreduce(jnp.arange(8.0), 2, algorithm="gtopk")
      >>> total.indices.tolist(), total.values.tolist() == [6.0 * P, 7.0 * P]
      ([6, 7], True)
      >>> residuals = MPI.COMM_WORLD.allreduce(np.asarray(residual), op=MPI.SUM)
      >>> bool(np.all(total.to_dense() + residuals == P * np.arange(8.0)))
      True
    """
    comm = resolve_comm(comm)
    try:
        plan, size, k = _check(comm, x, k, algorithm, transport, delta)
    except (TypeError, ValueError) as e:
        reject_everywhere(comm, e)
    total, residual, stats = call_and_recover(_compiled(plan, algorithm, size, k), x)
    return (total, residual, stats) if return_stats else (total, residual)


def _check(comm: MPI.Comm, x, k, algorithm: str, transport: str, delta: float) -> tuple[Plan, int, int]:
    if isinstance(x, SparseStream):
        raise TypeError("x must be this rank's dense float32 accumulator (gradient plus residual), got a "
                        "SparseStream; pass stream.to_dense()")
    x = check_vector(x, "x")
    check_transport(transport)
    if algorithm not in GLOBAL_TOPK_ALGORITHMS:
        raise ValueError(f"algorithm must be one of {GLOBAL_TOPK_ALGORITHMS}, got {algorithm!r}")
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
        raise TypeError(f"k must be a static Python int (the size of the result), got {type(k).__name__}; "
                        "under jax.jit mark it static")
    size = x.shape[0]
    if not 0 <= k <= size:
        raise ValueError(f"k={k} must lie in [0, len(x)={size}]; clip it, e.g. k=min(k, x.size)")
    dense_threshold(1, delta)  # raises for a delta that is not positive
    return Plan(comm, transport, float(delta)), size, int(k)


@functools.lru_cache(maxsize=128)
def _compiled(plan: Plan, algorithm: str, size: int, k: int):
    code = GLOBAL_TOPK_ALGORITHMS.index(algorithm)

    @jax.jit
    def run(x: jax.Array):
        signature = native.Signature.of("global_topk", size=size, k=k, algorithm=code, transport=plan.transport,
                                        delta=plan.delta)
        stream = dense_stream(x)
        if plan.transport == "native":
            program = _program(plan, algorithm, size, k)
            total, residual, sent = native.run_global_topk(program, stream, comm=plan.comm, signature=signature,
                                                           delta=plan.delta)
        else:
            agreed = native.agree(stream, comm=plan.comm, signature=signature)  # static buffers cannot carry an abort
            t = Mpi4jaxTransport(plan.comm, plan.delta, size, agreed)
            total, held = definition(algorithm)(t, stream, k=k)
            residual, sent = held.values, t.sent
        stats = GlobalTopkStats(jnp.int32(code), sent, total.nnz, jnp.sum(jnp.abs(residual)))
        return total, residual, stats

    return run


@functools.lru_cache(maxsize=128)
def _program(plan: Plan, algorithm: str, size: int, k: int) -> native.Program:
    return native.record(definition(algorithm), rank=plan.rank, nprocs=plan.nprocs, delta=plan.delta, size=size,
                         capacity=size, code=GLOBAL_TOPK_ALGORITHMS.index(algorithm), k=k)
