"""DSAR_Split_allgather (SparCML §5.2, Algorithm 3): sparse reduce-scatter, dense allgather.

After the split phase each rank owns the dense sum of its N/P range, and a dense allgather
finishes the job: ``(P-1)/P * (2k + N)`` values on the wire, never worse than a dense allreduce.
With ``quantize`` the dense phase carries QSGD codes instead of float32 (SparCML §6): every
rank decodes the same bytes, so all ranks still hold identical results.
"""

from __future__ import annotations

from sparcml_jax.comm import Quantize, S, Transport


def dsar_split_allgather(t: Transport[S], s: S, quantize: Quantize | None = None) -> S:
    mine = t.reduce_scatter(s, dense=True)  # rank r: the dense sum of range r
    return t.allgather(mine, dense=True, quantize=quantize)
