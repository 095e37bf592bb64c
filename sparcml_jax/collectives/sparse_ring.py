"""The sparse ring allreduce (SparCML's ``c_allreduce_ring``, the variant of its CNTK integration).

The vector is split into P segments. In P - 1 reduce-scatter rounds every rank passes one
segment to its right neighbour, which adds it into its own copy: after them rank r holds the
whole sum of segment r + 1. In P - 1 allgather rounds the finished segments travel on around the
ring. Each segment is sparse or dense on its own count, merging as it goes; the result is
densified if it crosses delta. Bandwidth-optimal like a dense ring (every rank sends 2 (P - 1)
segments), with latency ``2 (P - 1) alpha``.
"""

from __future__ import annotations

from sparcml_jax.comm import S, Transport


def sparse_ring(t: Transport[S], s: S) -> S:
    p = t.nprocs
    segments = t.split(s, fan_in=p)  # each with room for the sum over every rank
    for i in range(p - 1):  # rank r adds segment r - 1 - i, which rank r - 1 has summed over i + 1 ranks
        segments = t.ring_pass(segments, send=-i, into=-i - 1, combine="add")
    for i in range(p - 1):  # rank r holds the whole sum of segment r + 1 - i and passes it on
        segments = t.ring_pass(segments, send=1 - i, into=-i, combine="replace")
    return t.concat(segments)
