"""SSAR_Split_allgather (SparCML §5.2, Algorithm 2): split, sparse reduce-scatter, sparse allgather.

The index space is split into P ranges; each rank sends range r of its stream directly to rank r,
which sums what it receives; a concatenating allgather then hands every rank every summed range.
Best when the result stays sparse: each pair crosses the network about twice.
"""

from __future__ import annotations

import jax.numpy as jnp

from sparcml_jax.collectives._plan import Plan, Progress
from sparcml_jax.comm.topology import gathered_capacity, largest_part_capacity, part_capacity
from sparcml_jax.stream import SparseStream


def split_phase(s: SparseStream, plan: Plan) -> tuple[SparseStream, Progress]:
    """Round 0 of both split algorithms: rank r ends with the sum of range r (local indices)."""
    part, status, sent = plan.transport.reduce_scatter(
        s, part_capacity=part_capacity(s.capacity, s.size, plan.nprocs, plan.rank, plan.delta),
        status=jnp.int32(0), comm=plan.comm, delta=plan.delta,
    )
    return part, Progress.start().after(0, status, sent, part.is_dense)


def ssar_split_allgather(s: SparseStream, plan: Plan) -> tuple[SparseStream, Progress]:
    t, comm, nprocs, delta = plan.transport, plan.comm, plan.nprocs, plan.delta
    part, progress = split_phase(s, plan)
    result, status, sent = t.allgather(
        part, size=s.size, out_capacity=gathered_capacity(s.capacity, s.size, nprocs, delta), status=progress.status,
        comm=comm, delta=delta,
        slot_capacity=largest_part_capacity(s.capacity, s.size, nprocs, delta),
    )
    return result, progress.after(1, status, sent, result.is_dense)
