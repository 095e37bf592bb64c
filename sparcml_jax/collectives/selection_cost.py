"""The cost model's price of a top-k selection, measured on a communicator.

The global top-k algorithms select inside the collective (SparDL re-selects every block before it
sends it, gTop-k selects at every merge) and take the dense accumulator, so their local work is a
selection over N values. :func:`sparcml_jax.topk` is a radix selection: histograms of the values'
keys, bound by compute rather than by memory, so its price per value is measured on its own
instead of as a multiple of a memory pass.
"""

from __future__ import annotations

import functools

import numpy as np
from mpi4py import MPI


@functools.cache
def _selection_program(k: int):
    import jax

    from sparcml_jax.kernels.topk import topk

    return jax.jit(lambda v: topk(v, k))


def measure_select_cost(comm: MPI.Comm, size: int = 1 << 21, density: float = 0.01, reps: int = 3) -> float:
    """Seconds per value of a top-k selection of ``density * size`` of ``size`` random float32
    values, every rank selecting at once (ranks that share a core are measured sharing it): the
    slowest rank's median over ``reps``, the fastest of three such blocks (as the calibration's
    other prices), rank 0's number on every rank. A collective call.

    Example (under ``mpirun -n P``):
      >>> from mpi4py import MPI
      >>> from sparcml_jax.collectives.selection_cost import measure_select_cost
      >>> cost = measure_select_cost(MPI.COMM_WORLD, size=1 << 16, reps=3)
      >>> 0.0 < cost < 1e-6
      True
    """
    import jax
    import jax.numpy as jnp

    from sparcml_jax.collectives.calibrate import _steadiest, slowest_rank_median
    from sparcml_jax.comm._compat import outside_trace

    def time_selection() -> float:
        values = jnp.asarray(np.random.default_rng(comm.Get_rank()).random(size, np.float32) - 0.5)
        select = _selection_program(max(1, int(density * size)))
        for _ in range(2):  # the heap grows on the first calls
            jax.block_until_ready(select(values))
        return _steadiest(lambda: slowest_rank_median(comm, lambda: jax.block_until_ready(select(values)), reps)) / size

    return float(comm.bcast(outside_trace(time_selection), root=0))
