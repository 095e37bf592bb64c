"""Measuring the cost model's terms on a communicator (only ``auto`` needs them).

Every term is measured as the collectives meet it: on every rank at once (ranks that share a core
or the memory bus are measured sharing them), past the caches, and the slowest rank's median.
``python -m sparcml_jax.bench calibrate --out FILE`` saves the result for ``SPARCML_JAX_COST_MODEL``,
so that a job pays for calibration once, not at every start.
"""

from __future__ import annotations

import functools
import time

import numpy as np
from mpi4py import MPI

from sparcml_jax.comm._compat import outside_trace


def measure(comm: MPI.Comm, small_reps: int = 50, large_bytes: int = 16 << 20, large_reps: int = 15,
            dense_bytes: int = 16 << 20) -> tuple[float, ...]:
    """(alpha, beta, dense_alpha, dense_beta, pair_cost, element_cost) on ``comm``, rank 0's
    numbers on every rank (so that every rank makes the same choices); see :class:`CostModel`.

    A collective call: every rank of ``comm`` must make it. The ranks first agree that they all
    calibrate (in the native transport's protocol, so that a rank that meanwhile entered a
    collective raises instead of waiting), then measure on a duplicate of ``comm``.
    """
    import jax.numpy as jnp

    from sparcml_jax.comm import native
    from sparcml_jax.stream import SparseStream

    empty = SparseStream(jnp.zeros((0,), jnp.int32), jnp.zeros((0,), jnp.float32), jnp.int32(0), 0)
    int(native.agree(empty, comm=comm, signature=native.Signature.of("calibrate")))
    if comm.Get_size() < 2:
        return (0.0,) * 6
    comm = comm.Dup()
    small = np.zeros(1, np.float64)
    _pairwise_exchange(comm, large_bytes, 2)  # MPICH sets up its large-message path on first use
    t_large = _pairwise_exchange(comm, large_bytes, large_reps)
    dense_slope = _jitted_allreduce_slope(comm, dense_bytes // 4, large_reps)
    # Small operations on ranks that share cores run in phases: in a fresh process a whole
    # block of 50 small allreduces or ping-pongs took 1.3-1.4 ms each instead of 30 us. The
    # fastest of three blocks is the steady state.
    alpha = max(_steadiest(lambda: _ping_pong(comm, small, small_reps)), 1e-7)
    beta = max((t_large - alpha) / large_bytes, 1e-12)
    d_small = _steadiest(lambda: _allreduce_seconds(comm, 2, small_reps))
    dense_beta = max(dense_slope / dense_bytes, 1e-12)
    pair_cost, element_cost = _compute_costs(comm)
    numbers = comm.bcast((alpha, beta, d_small, dense_beta, pair_cost, element_cost), root=0)
    comm.Free()
    return numbers


def _steadiest(measure, tries: int = 3) -> float:
    return min(measure() for _ in range(tries))


def slowest_rank_median(comm: MPI.Comm, run, reps: int, before=None) -> float:
    """Median over ``reps`` calls of ``run()`` (after one warm-up) of the slowest rank's time,
    every call started by all ranks together after a barrier (and after ``before()``, untimed)."""
    times = []
    for _ in range(reps + 1):
        if before is not None:
            before()
        comm.Barrier()
        start = time.perf_counter()
        run()
        times.append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
    return float(np.median(times[1:]))


def _allreduce_seconds(comm: MPI.Comm, count: int, reps: int = 5) -> float:
    """Median time of an MPI_Allreduce of ``count`` float32 (max over ranks)."""
    buf, out = np.ones(count, np.float32), np.empty(count, np.float32)
    return slowest_rank_median(comm, lambda: comm.Allreduce(buf, out, op=MPI.SUM), reps)


def _jitted_allreduce_slope(comm: MPI.Comm, count: int, reps: int) -> float:
    """Seconds that ``count`` float32 add to the dense allreduce as a training step runs it: a
    jitted :func:`~sparcml_jax.dense_allreduce` (MPI_Allreduce through XLA, into a fresh output
    buffer), the slowest rank's median, less the same program on 2 values (its dispatch). On
    NumPy buffers the same MPI_Allreduce costs 20-40 % less per byte on a node here, a price
    below what auto's dense path costs in a step."""
    import jax
    import jax.numpy as jnp

    from sparcml_jax.collectives.dense import dense_allreduce

    program = jax.jit(lambda v: dense_allreduce(v, comm=comm))

    def timed(size: int, reps: int = reps) -> float:
        vector = jnp.ones(size, jnp.float32)
        for _ in range(2):  # compiled, and the heaps grown
            jax.block_until_ready(program(vector))
        return slowest_rank_median(comm, lambda: jax.block_until_ready(program(vector)), reps)

    return outside_trace(lambda: max(timed(count) - timed(2, reps=5), 0.0))


@functools.cache
def _pass_program():
    """A pass as the collectives make them: XLA reads a vector into a fresh buffer."""
    import jax

    return jax.jit(lambda v: v * 2.0)


# The merge workload of both calibrations: streams of MERGE_PAIRS sorted, distinct indices (one
# random index per stride of MERGE_SIZE / MERGE_PAIRS, density 1/16), megabytes past the caches.
MERGE_SIZE, MERGE_PAIRS = 1 << 23, 1 << 19


def merge_indices(rng: np.random.Generator) -> np.ndarray:
    stride = MERGE_SIZE // MERGE_PAIRS
    return (np.arange(MERGE_PAIRS) * stride + rng.integers(0, stride, MERGE_PAIRS)).astype(np.int32)


def merge_chain(*indices):
    """Merges as a collective chains them: two merges, then a merge of their fresh results; it
    reads 2k + 2k + 4k pairs. (One merge alone came out at 1.9-3.9 ns per pair at P = 4 from one
    calibration to the next, the chain at 3.0-3.9, like recursive doubling's merges.)"""
    import jax.numpy as jnp

    from sparcml_jax.kernels.merge import merge
    from sparcml_jax.stream import SparseStream

    a, b, c, d = (SparseStream(i, jnp.ones(MERGE_PAIRS, jnp.float32), jnp.int32(MERGE_PAIRS), MERGE_SIZE)
                  for i in indices)
    return merge(merge(a, b), merge(c, d)).values


def _compute_costs(comm: MPI.Comm) -> tuple[float, float]:
    """Per-pair merge cost and per-element pass cost, each the slowest rank's median with every
    rank running at once, so that ranks sharing a core or the memory bus are measured sharing
    them. Both work on megabytes, past the caches, as the collectives that matter do."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    merged = jax.jit(merge_chain)
    # A pass over 16 MB. (An in-place numpy pass on 4 MB, the earlier measure, stayed in cache:
    # 0.05-0.09 ns per element where this pass takes 0.55 ns per element at P = 2 and 1.05 ns at
    # P = 4, so auto priced densify and padding passes 5x too low and chose mpi4jax's dense path
    # at 10 %.)
    doubled = _pass_program()

    def time_both():
        inputs, vector = [jnp.asarray(merge_indices(rng)) for _ in range(4)], jnp.ones(1 << 22, jnp.float32)
        for _ in range(8):  # the heaps grow on the first calls (page faults, 3-4x slower)
            jax.block_until_ready((merged(*inputs), doubled(vector)))
        # Every sample starts on all ranks at once. (Timed rank by rank after one warm-up call,
        # the cost came out 1.9 or 5.5 ns per pair at P = 4 from one calibration to the next.)
        # A slow phase of a shared machine can inflate a whole block several-fold (a pass cost
        # 1.39 ns per element in one calibration at P = 2, 0.25-0.44 in eleven others), and one
        # inflated price tips auto's choices: the fastest of three interleaved blocks is the
        # steady state, as for alpha.
        blocks = [(slowest_rank_median(comm, lambda: jax.block_until_ready(merged(*inputs)), 5),
                   slowest_rank_median(comm, lambda: jax.block_until_ready(doubled(vector)), 5))
                  for _ in range(3)]
        chain_seconds, pass_seconds = (min(times) for times in zip(*blocks))
        # A pass reads and writes each element.
        return chain_seconds / (8 * MERGE_PAIRS), pass_seconds / (2 * vector.size)

    return outside_trace(time_both)


def _pairwise_exchange(comm: MPI.Comm, nbytes: int, reps: int) -> float:
    """Median time (max over ranks) of every rank exchanging ``nbytes`` with rank ^ 1 at once."""
    partner = comm.Get_rank() ^ 1
    send, recv = np.ones(nbytes // 8, np.float64), np.empty(nbytes // 8, np.float64)

    def exchange():
        if partner < comm.Get_size():
            comm.Sendrecv(send, dest=partner, sendtag=78, recvbuf=recv, source=partner, recvtag=78)

    return slowest_rank_median(comm, exchange, reps)


def _ping_pong(comm: MPI.Comm, buf: np.ndarray, reps: int) -> float:
    """Median one-way time of ``buf`` between ranks 0 and 1 (other ranks wait at the barrier)."""
    rank = comm.Get_rank()
    times = []
    comm.Barrier()
    for _ in range(reps + 1):
        start = time.perf_counter()
        if rank == 0:
            comm.Send(buf, dest=1, tag=77)
            comm.Recv(buf, source=1, tag=77)
        elif rank == 1:
            comm.Recv(buf, source=0, tag=77)
            comm.Send(buf, dest=0, tag=77)
        times.append((time.perf_counter() - start) / 2)
    comm.Barrier()
    return float(np.median(times[1:]))
