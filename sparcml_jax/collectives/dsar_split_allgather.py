"""DSAR_Split_allgather (SparCML §5.2, Algorithm 3): sparse reduce-scatter, dense allgather.

After the split phase each rank owns the dense sum of its N/P range, and a dense allgather
finishes the job: ``(P-1)/P * (2k + N)`` values on the wire, never worse than a dense allreduce.
With ``quantize_bits`` the dense phase carries QSGD codes instead of float32 (SparCML §6): every
rank dequantizes the same bytes, so all ranks still hold identical results.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import mpi4jax

from sparcml_jax.collectives._plan import Plan, Progress
from sparcml_jax.comm.topology import longest_part, part_capacity, part_length
from sparcml_jax.stream import SparseStream, dense_stream


def dense_split_phase(s: SparseStream, plan: Plan) -> tuple[jax.Array, Progress]:
    """Round 0: rank r ends with the dense sum of range r (the ranges travel as in the SSAR split)."""
    mine, is_dense, status, sent = plan.transport.reduce_scatter_dense(
        s, part_capacity=part_capacity(s.capacity, s.size, plan.nprocs, plan.rank, plan.delta),
        status=jnp.int32(0), comm=plan.comm, delta=plan.delta,
    )
    return mine, Progress.start().after(0, status, sent, is_dense)


def dsar_split_allgather(s: SparseStream, plan: Plan, key: jax.Array | None = None) -> tuple[SparseStream, Progress]:
    t, comm = plan.transport, plan.comm
    mine, progress = dense_split_phase(s, plan)
    status = progress.status
    if plan.quantize_bits is None:
        result, status, sent = t.allgather_dense(mine, size=s.size, status=progress.status, comm=comm)
    else:
        values, sent = _quantized_allgather(mine, s.size, plan, jax.random.fold_in(key, plan.rank))
        result = dense_stream(values)
    return result, progress.after(1, status, sent, jnp.bool_(True))


def _quantized_allgather(mine: jax.Array, size: int, plan: Plan, key: jax.Array):
    """QSGD-codes this rank's slice, allgathers the codes (static size) and decodes every slice."""
    from sparcml_jax.kernels.qsgd import QuantizedVector, qsgd_dequantize, qsgd_quantize

    nprocs = plan.nprocs
    slot = longest_part(size, nprocs)
    padded = jnp.concatenate([mine, jnp.zeros((slot - mine.shape[0],), mine.dtype)])
    q = qsgd_quantize(padded, key, bits=plan.quantize_bits, bucket_size=plan.bucket_size, scale=plan.quantize_scale)
    if nprocs > 1:
        packed = mpi4jax.allgather(q.data, comm=plan.comm)
        scales = mpi4jax.allgather(q.scales, comm=plan.comm)
    else:
        packed, scales = q.data[None], q.scales[None]
    pieces = []
    for r in range(nprocs):
        decoded = qsgd_dequantize(QuantizedVector(packed[r], scales[r], q.size, q.bits, q.bucket_size, q.scale))
        pieces.append(decoded[: part_length(size, nprocs, r)])
    sent = jnp.float32((q.data.size + 4 * q.scales.size) * (nprocs - 1))
    return jnp.concatenate(pieces), sent
