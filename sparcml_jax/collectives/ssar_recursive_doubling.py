"""SSAR_Recursive_double (SparCML §5.2, Algorithm 1): log2 P rounds of exchange + merge.

Best for small data: latency ``log P * alpha``; bandwidth between ``k log P`` (identical
supports) and ``k (P - 1)`` pairs (disjoint supports). A non-power of two P first folds the
``P - P'`` extra ranks into the lower power of two ``P'`` and unfolds the result after.
"""

from __future__ import annotations

from sparcml_jax.collectives._plan import Plan, Progress
from sparcml_jax.comm.topology import grown_capacity, lower_power_of_two
from sparcml_jax.kernels.merge import merge
from sparcml_jax.stream import SparseStream, resize


def ssar_recursive_doubling(s: SparseStream, plan: Plan) -> tuple[SparseStream, Progress]:
    t, comm, r, nprocs = plan.transport, plan.comm, plan.rank, plan.nprocs
    lower = lower_power_of_two(nprocs)
    extra = nprocs - lower
    progress = Progress.start()
    capacity = s.capacity
    round_index = 0

    def grow(stream, received, capacity):
        return merge(stream, received, delta=plan.delta, capacity=grown_capacity(capacity, s.size, 2, plan.delta))

    if extra:  # fold
        if r >= lower:
            _, status, sent = t.exchange(s, dest=r - lower, source=None, recv_capacity=capacity,
                                         status=progress.status, comm=comm, round=round_index, delta=plan.delta)
        elif r < extra:
            got, status, sent = t.exchange(s, dest=None, source=r + lower, recv_capacity=capacity,
                                           status=progress.status, comm=comm, round=round_index, delta=plan.delta)
            s = grow(s, got, capacity)
        else:
            status, sent = progress.status, 0.0
        capacity = grown_capacity(capacity, s.size, 2, plan.delta)
        s = resize(s, capacity)
        progress = progress.after(round_index, status, sent, s.is_dense)
        round_index += 1

    distance = 1
    while distance < lower:
        if r < lower:
            partner = r ^ distance
            got, status, sent = t.exchange(s, dest=partner, source=partner, recv_capacity=capacity,
                                           status=progress.status, comm=comm, round=round_index, delta=plan.delta)
            s = grow(s, got, capacity)
            progress = progress.after(round_index, status, sent, s.is_dense)
        capacity = grown_capacity(capacity, s.size, 2, plan.delta)
        distance *= 2
        round_index += 1

    if extra:  # unfold
        if r < extra:
            _, status, sent = t.exchange(s, dest=r + lower, source=None, recv_capacity=capacity,
                                         status=progress.status, comm=comm, round=round_index, delta=plan.delta)
            progress = progress.after(round_index, status, sent, s.is_dense)
        elif r >= lower:
            s, status, sent = t.exchange(resize(s, capacity), dest=None, source=r - lower, recv_capacity=capacity,
                                         status=progress.status, comm=comm, round=round_index, delta=plan.delta)
            progress = progress.after(round_index, status, sent, s.is_dense)
    return s, progress
