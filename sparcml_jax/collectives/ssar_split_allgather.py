"""SSAR_Split_allgather (SparCML §5.2, Algorithm 2): split, sparse reduce-scatter, sparse allgather.

The index space is split into P ranges; each rank sends range r of its stream directly to rank r,
which sums what it receives; a concatenating allgather then hands every rank every summed range.
Best when the result stays sparse: each pair crosses the network about twice.
"""

from __future__ import annotations

from sparcml_jax.comm import S, Transport


def ssar_split_allgather(t: Transport[S], s: S) -> S:
    part = t.reduce_scatter(s)  # rank r: the sum of range r, sparse or dense on its own count
    return t.allgather(part)
