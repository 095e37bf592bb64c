"""DSAR_Split_allgather (SparCML §5.2, Algorithm 3): sparse reduce-scatter, dense allgather.

After the split phase each rank owns the dense sum of its N/P range, and a dense allgather
finishes the job: ``(P-1)/P * (2k + N)`` values on the wire, never worse than a dense allreduce.
With ``quantize`` both phases carry QSGD codes wherever they carry dense values (SparCML §6;
CGX's scatter-reduce-allgather behind SparCML's sparse/dense switch): a split-phase segment that
turned dense travels coded and is summed in float32 by its owner, while sparse segments stay
exact pairs; in the allgather every rank decodes the same bytes, so all ranks still hold
identical results. At b bits a dense vector costs about ``2 (P-1)/P * N * b/8`` bytes per rank
plus one float32 scale per bucket, against ``2 (P-1)/P * 4N`` for the float32 dense allreduce.
"""

from __future__ import annotations

from sparcml_jax.comm import Quantize, S, Transport


def dsar_split_allgather(t: Transport[S], s: S, quantize: Quantize | None = None,
                         feedback: bool = False) -> S | tuple[S, S]:
    """The sum; with ``feedback`` also what the split phase's coding lost on this rank, for error
    feedback (the allgather's error is the same on every rank: left to QSGD's unbiasedness)."""
    if not feedback:
        mine = t.reduce_scatter(s, dense=True, quantize=quantize)  # rank r: the dense sum of range r
        return t.allgather(mine, dense=True, quantize=quantize)
    mine, error = t.reduce_scatter(s, dense=True, quantize=quantize, feedback=True)
    return t.allgather(mine, dense=True, quantize=quantize), error
