"""mpi4jax transport: the same collectives from mpi4jax ops with static buffers.

mpi4jax has no variable-length messages, so every message carries its whole static capacity:
``[nnz, status, indices..., bitcast(values)...]`` as one int32 buffer, or, for the exchanges of
recursive doubling, ``[nnz, status]``, ``[indices...]`` and ``[values...]`` as three messages:
indices and values then go straight from and into XLA's buffers. (Packing the values with the
indices cost 3.8-4.1 ms against 2.2-2.4 ms at N = 2^22, 1 %, P = 4. Packing the header with the
indices copied them on both sides of every round, 1.7 and 3.4 MB at 10 %, and recursive doubling
there measured 1.04-1.29x the dense allreduce; without the copies, 0.78-1.05x.)
Once a stream's capacity reaches the dense length, it travels as the dense vector instead (4
bytes per entry, not 8).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import mpi4jax
import numpy as np
from mpi4py import MPI

from sparcml_jax.comm.topology import check_peers, longest_part, part_bounds, part_length, segment_slot
from sparcml_jax.kernels.partition import partition_bounds
from sparcml_jax.stream import INDEX_DTYPE, VALUE_DTYPE, SparseStream, dense_stream, dense_threshold, resize

NAME = "mpi4jax"
_TAG_BASE = 0x5CB0
_INDICES_TAG, _VALUES_TAG = 0x20, 0x40  # added to a round's tag for its indices and values messages
_HEADER = 2


def _header(nnz, status) -> jax.Array:
    return jnp.stack([jnp.asarray(nnz, INDEX_DTYPE), jnp.asarray(status, INDEX_DTYPE)])


def _pack(idx: jax.Array, val: jax.Array, nnz, status) -> jax.Array:
    return jnp.concatenate([_header(nnz, status), idx, jax.lax.bitcast_convert_type(val, INDEX_DTYPE)])


def _unpack(buf: jax.Array, capacity: int):
    idx = buf[_HEADER:_HEADER + capacity]
    val = jax.lax.bitcast_convert_type(buf[_HEADER + capacity:], VALUE_DTYPE)
    return idx, val, buf[0], buf[1]


def exchange(s: SparseStream, *, dest: int | None, source: int | None, recv_capacity: int, status: jax.Array,
             comm: MPI.Comm, round: int = 0, delta: float = 1.0):
    check_peers(comm, dest=dest, source=source)
    if dest is not None and source is not None and recv_capacity != s.capacity:
        raise ValueError(f"mpi4jax transport: static exchange needs equal capacities ({s.capacity} != {recv_capacity})")
    tag = _TAG_BASE + round
    n = s.size
    # Once the buffers can hold the dense vector, a message of n int32 slots carries either the
    # dense values or, below SparCML's threshold, the (at most n // 2) pairs: 4 bytes per entry
    # instead of 8, and the switch still follows the actual count.
    compact = recv_capacity >= n and s.capacity >= n and dense_threshold(n, delta) - 1 <= n // 2
    if compact:
        messages = [(_pack_compact(s, status, delta), jnp.zeros((_HEADER + n,), INDEX_DTYPE), tag)]
    else:
        messages = [(_header(s.nnz, status), jnp.zeros((_HEADER,), INDEX_DTYPE), tag),
                    (s.indices, jnp.zeros((recv_capacity,), INDEX_DTYPE), tag + _INDICES_TAG),
                    (s.values, jnp.zeros((recv_capacity,), VALUE_DTYPE), tag + _VALUES_TAG)]
    received = []
    for payload, template, message_tag in messages:
        if dest is not None and source is not None:
            received.append(mpi4jax.sendrecv(payload, template, source, dest, sendtag=message_tag,
                                             recvtag=message_tag, comm=comm))
        elif dest is not None:
            mpi4jax.send(payload, dest, tag=message_tag, comm=comm)
        elif source is not None:
            received.append(mpi4jax.recv(template, source, tag=message_tag, comm=comm))
    sent = jnp.float32(sum(4 * payload.shape[0] for payload, _, _ in messages) if dest is not None else 0)
    if not received:
        return SparseStream.empty(n, recv_capacity), status, sent
    if compact:
        got, peer_status = _unpack_compact(received[0], n, recv_capacity)
        return got, jnp.maximum(status, peer_status), sent
    header, indices, values = received
    return SparseStream(indices, values, header[0], n), jnp.maximum(status, header[1]), sent


def _pack_compact(s: SparseStream, status, delta: float) -> jax.Array:
    """[nnz, status, n slots]: the dense values when nnz reaches the threshold, else the pairs."""
    n, half = s.size, s.size // 2
    go_dense = s.nnz >= dense_threshold(n, delta)
    pairs = jnp.concatenate([s.indices[:half], jax.lax.bitcast_convert_type(s.values[:half], INDEX_DTYPE),
                             jnp.zeros((n - 2 * half,), INDEX_DTYPE)])
    dense = jax.lax.bitcast_convert_type(s.to_dense(), INDEX_DTYPE)
    body = jax.lax.cond(go_dense, lambda: dense, lambda: pairs)
    nnz = jnp.where(go_dense, n, s.nnz).astype(INDEX_DTYPE)
    return jnp.concatenate([_header(nnz, status), body])


def _unpack_compact(buf: jax.Array, n: int, capacity: int) -> tuple[SparseStream, jax.Array]:
    half = n // 2
    nnz, body = buf[0], buf[_HEADER:]
    dense = resize(dense_stream(jax.lax.bitcast_convert_type(body, VALUE_DTYPE)), capacity)
    pairs = resize(SparseStream(body[:half], jax.lax.bitcast_convert_type(body[half:2 * half], VALUE_DTYPE), nnz, n),
                   capacity)
    got = jax.tree.map(lambda d, p: jnp.where(nnz == n, d, p), dense, pairs)
    return got, buf[1]


def _segments(s: SparseStream, parts: int, slot: int) -> jax.Array:
    """[parts, header + 2*slot]: the pairs of each part's range, re-based to the range start."""
    bounds = partition_bounds(s.size, parts).astype(np.int32)
    offsets = jnp.searchsorted(s.indices, jnp.asarray(bounds), side="left").astype(INDEX_DTYPE)
    offsets = jnp.minimum(offsets, s.nnz)
    padded = resize(s, s.capacity + slot)
    rows = []
    for r in range(parts):
        count = offsets[r + 1] - offsets[r]
        idx = jax.lax.dynamic_slice(padded.indices, (offsets[r],), (slot,)) - bounds[r]
        val = jax.lax.dynamic_slice(padded.values, (offsets[r],), (slot,))
        valid = jnp.arange(slot) < count
        length = part_length(s.size, parts, r)
        rows.append(_pack(jnp.where(valid, idx, length), jnp.where(valid, val, 0.0), count, 0))
    return jnp.stack(rows)


def reduce_scatter(s: SparseStream, *, part_capacity: int, status: jax.Array, comm: MPI.Comm, delta: float):
    from sparcml_jax.kernels.merge import merge

    rank, parts = comm.Get_rank(), comm.Get_size()
    slot = segment_slot(s.capacity, s.size, parts)
    sendbuf = _segments(s, parts, slot)
    sendbuf = sendbuf.at[:, 1].set(status)
    received = mpi4jax.alltoall(sendbuf, comm=comm) if parts > 1 else sendbuf
    length = part_length(s.size, parts, rank)
    acc = None
    for q in range(parts):
        idx, val, nnz, peer_status = _unpack(received[q], slot)
        status = jnp.maximum(status, peer_status)
        seg = SparseStream(idx, val, nnz, length)
        acc = seg if acc is None else merge(acc, seg, delta=delta)
    sent = jnp.float32(4 * sendbuf.shape[1] * (parts - 1))
    return resize(acc, part_capacity), status, sent


def allgather(part: SparseStream, *, size: int, out_capacity: int, status: jax.Array, comm: MPI.Comm, delta: float,
              slot_capacity: int):
    from sparcml_jax.kernels.merge import merge_all

    parts = comm.Get_size()
    mine = resize(part, slot_capacity)
    buf = _pack(mine.indices, mine.values, mine.nnz, status)
    gathered = mpi4jax.allgather(buf, comm=comm) if parts > 1 else buf[None]
    status = jnp.max(gathered[:, 1])
    streams = []
    for r in range(parts):  # each part re-based to global indices, its padding to `size`
        idx, val, count, _ = _unpack(gathered[r], slot_capacity)
        valid = jnp.arange(slot_capacity) < count
        streams.append(SparseStream(jnp.where(valid, idx + part_bounds(size, parts, r)[0], size), val, count, size))
    # The parts cover disjoint ranges in order, so merging them concatenates them and applies the
    # dense switch. Per-part XLA scatters made the algorithm 1.6-2.1x slower (P = 2, N = 2^22).
    if parts == 1:  # nothing to merge: a merge with nothing applies the dense switch all the same
        streams.append(SparseStream.empty(size, 0))
    result = resize(merge_all(streams, delta=delta), out_capacity)
    sent = jnp.float32(4 * buf.shape[0] * (parts - 1))
    return result, status, sent


def reduce_scatter_dense(s: SparseStream, *, part_capacity: int, status: jax.Array, comm: MPI.Comm, delta: float):
    """:func:`reduce_scatter`, then the dense slice of the part (DSAR's split phase)."""
    part, status, sent = reduce_scatter(s, part_capacity=part_capacity, status=status, comm=comm, delta=delta)
    return part.to_dense(), part.is_dense, status, sent


def allgather_dense(values: jax.Array, *, size: int, status: jax.Array, comm: MPI.Comm):
    """Concatenates every rank's dense slice of its range (the DSAR allgather phase): a dense stream."""
    parts = comm.Get_size()
    slot = longest_part(size, parts)
    buf = jnp.concatenate([values, jnp.zeros((slot - values.shape[0],), VALUE_DTYPE)])
    gathered = mpi4jax.allgather(buf, comm=comm) if parts > 1 else buf[None]
    pieces = [gathered[r, : part_length(size, parts, r)] for r in range(parts)]
    return dense_stream(jnp.concatenate(pieces)), status, jnp.float32(4 * slot * (parts - 1))


def allreduce_dense(s: SparseStream, *, comm: MPI.Comm) -> SparseStream:
    """MPI_Allreduce of the densified stream (mpi4jax): the dense baseline, as a dense stream."""
    return dense_stream(mpi4jax.allreduce(s.to_dense(), op=MPI.SUM, comm=comm))


def gather_streams(s: SparseStream, *, status: jax.Array, comm: MPI.Comm):
    """Every rank's whole stream: (indices[P, cap], values[P, cap], nnz[P])."""
    buf = _pack(s.indices, s.values, s.nnz, status)
    gathered = mpi4jax.allgather(buf, comm=comm) if comm.Get_size() > 1 else buf[None]
    cap = s.capacity
    idx = gathered[:, _HEADER:_HEADER + cap]
    val = jax.lax.bitcast_convert_type(gathered[:, _HEADER + cap:], VALUE_DTYPE)
    return (idx, val, gathered[:, 0]), jnp.max(gathered[:, 1]), jnp.float32(4 * buf.shape[0] * (comm.Get_size() - 1))
