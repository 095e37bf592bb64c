"""Native transport: our own MPI FFI ops that send only the valid entries of a stream.

Each message is a header plus either ``nnz`` (index, value) pairs or a dense slice, received
with ``MPI_Mprobe``/``MPI_Get_count``/``MPI_Mrecv`` (SparCML §5). A ``status`` scalar travels
through every op: a rank that failed keeps taking part in the schedule but sends an error header,
so its peers never block, and :func:`check` makes every rank raise at the end.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from mpi4py import MPI

from sparcml_jax.comm._ordered import i64, ordered_ffi_primitive
from sparcml_jax.comm.topology import check_peers, part_length
from sparcml_jax.stream import INDEX_DTYPE, VALUE_DTYPE, SparseStream, dense_threshold

NAME = "native"
_TAG_BASE = 0x5CA0
_ShapedArray = jax.core.ShapedArray


def _stream_results(capacity: int):
    return [
        _ShapedArray((capacity,), INDEX_DTYPE),
        _ShapedArray((capacity,), VALUE_DTYPE),
        _ShapedArray((), INDEX_DTYPE),
        _ShapedArray((), INDEX_DTYPE),  # status
        _ShapedArray((), VALUE_DTYPE),  # bytes sent
    ]


_exchange_p = ordered_ffi_primitive(
    "sparcml_exchange", "sparcml_mpi_exchange", "SparcmlMpiExchange",
    lambda *avals, recv_capacity, **_: _stream_results(int(recv_capacity)), shape_params=("recv_capacity",),
)
_reduce_scatter_p = ordered_ffi_primitive(
    "sparcml_reduce_scatter", "sparcml_mpi_reduce_scatter", "SparcmlMpiReduceScatter",
    lambda *avals, part_capacity, **_: _stream_results(int(part_capacity)), shape_params=("part_capacity",),
)
_allgather_p = ordered_ffi_primitive(
    "sparcml_allgather", "sparcml_mpi_allgather", "SparcmlMpiAllgather",
    lambda *avals, out_capacity, **_: _stream_results(int(out_capacity)), shape_params=("out_capacity",),
)
_gather_streams_p = ordered_ffi_primitive(
    "sparcml_gather_streams", "sparcml_mpi_gather_streams", "SparcmlMpiGatherStreams",
    lambda idx, val, nnz, status, *, nprocs, **_: [
        _ShapedArray((int(nprocs), idx.shape[0]), INDEX_DTYPE), _ShapedArray((int(nprocs), idx.shape[0]), VALUE_DTYPE),
        _ShapedArray((int(nprocs),), INDEX_DTYPE), _ShapedArray((), INDEX_DTYPE), _ShapedArray((), VALUE_DTYPE),
    ],
    shape_params=("nprocs",),
)
_summary_p = ordered_ffi_primitive(
    "sparcml_summary", "sparcml_mpi_summary", "SparcmlMpiSummary",
    lambda *avals, **_: [_ShapedArray((3,), INDEX_DTYPE)],
)
_check_p = ordered_ffi_primitive("sparcml_check", "sparcml_mpi_check", "SparcmlMpiCheck", lambda *avals, **_: [])
_reduce_scatter_dense_p = ordered_ffi_primitive(
    "sparcml_reduce_scatter_dense", "sparcml_mpi_reduce_scatter_dense", "SparcmlMpiReduceScatterDense",
    lambda *avals, length, **_: [_ShapedArray((int(length),), VALUE_DTYPE), _ShapedArray((), INDEX_DTYPE),
                                 _ShapedArray((), INDEX_DTYPE), _ShapedArray((), VALUE_DTYPE)],
    shape_params=("length",),
)
_allgather_dense_p = ordered_ffi_primitive(
    "sparcml_allgather_dense", "sparcml_mpi_allgather_dense", "SparcmlMpiAllgatherDense",
    lambda *avals, size, **_: [_ShapedArray((int(size),), INDEX_DTYPE), _ShapedArray((int(size),), VALUE_DTYPE),
                               _ShapedArray((), INDEX_DTYPE), _ShapedArray((), VALUE_DTYPE)],
    shape_params=("size",),
)
_allreduce_dense_p = ordered_ffi_primitive(
    "sparcml_allreduce_dense", "sparcml_mpi_allreduce_dense", "SparcmlMpiAllreduceDense",
    lambda *avals, size, **_: [_ShapedArray((int(size),), INDEX_DTYPE), _ShapedArray((int(size),), VALUE_DTYPE)],
    shape_params=("size",),
)


def _bind_stream(prim, s: SparseStream, status, size: int, **params):
    idx, val, nnz, status, sent = prim.bind(s.indices, s.values, s.nnz, status, **params)
    return SparseStream(idx, val, nnz, size), status, sent


def exchange(s: SparseStream, *, dest: int | None, source: int | None, recv_capacity: int, status: jax.Array,
             comm: MPI.Comm, round: int = 0, delta: float = 1.0):
    """Sends ``s`` to ``dest`` and receives a stream from ``source`` (None: that side is skipped).

    Only the valid pairs travel, or the dense values once the stream is dense; ``delta`` is not
    needed here because the sender's merge already applied the switch.
    """
    check_peers(comm, dest=dest, source=source)
    return _bind_stream(
        _exchange_p, s, status, s.size, recv_capacity=i64(recv_capacity), comm=i64(comm.py2f()),
        dest=i64(-1 if dest is None else dest), source=i64(-1 if source is None else source),
        tag=i64(_TAG_BASE + round), n=i64(s.size),
    )


def reduce_scatter(s: SparseStream, *, part_capacity: int, status: jax.Array, comm: MPI.Comm, delta: float):
    """Sums range r of every rank's stream on rank r. Returns this rank's part (local indices)."""
    rank, parts = comm.Get_rank(), comm.Get_size()
    return _bind_stream(
        _reduce_scatter_p, s, status, part_length(s.size, parts, rank), part_capacity=i64(part_capacity),
        comm=i64(comm.py2f()), tag=i64(_TAG_BASE + 64), n=i64(s.size), delta=float(delta),
    )


def allgather(part: SparseStream, *, size: int, out_capacity: int, status: jax.Array, comm: MPI.Comm, delta: float,
              slot_capacity: int | None = None):
    """Concatenates every rank's part (local indices of its range) into one stream of ``size``.

    Each part travels as its valid pairs or as its dense slice, whichever is smaller, so
    ``slot_capacity`` (the static message size of the mpi4jax transport) is not needed.
    """
    return _bind_stream(
        _allgather_p, part, status, size, out_capacity=i64(out_capacity), comm=i64(comm.py2f()),
        tag=i64(_TAG_BASE + 65), n=i64(size), delta=float(delta),
    )


def gather_streams(s: SparseStream, *, status: jax.Array, comm: MPI.Comm):
    """Every rank's whole stream: (indices[P, cap], values[P, cap], nnz[P]), valid entries only on the wire."""
    idx, val, nnz, status, sent = _gather_streams_p.bind(
        s.indices, s.values, s.nnz, status, nprocs=i64(comm.Get_size()), comm=i64(comm.py2f()),
        tag=i64(_TAG_BASE + 65), n=i64(s.size)
    )
    return (idx, val, nnz), status, sent


def summary(s: SparseStream, *, comm: MPI.Comm, signature: dict[str, int]) -> jax.Array:
    """The first MPI call of every collective: ranks agree on ``signature`` (static choices that
    must match everywhere) and validate their streams; any mismatch or bad stream raises on every
    rank. Returns [max nnz, min nnz, sum nnz] over ranks."""
    (out,) = _summary_p.bind(
        s.indices, s.nnz, comm=i64(comm.py2f()), n=i64(s.size),
        signature=tuple(int(v) for v in signature.values()), fields=",".join(signature),
    )
    return out


def check(status: jax.Array, *, comm: MPI.Comm) -> None:
    """Raises on every rank if any rank's status is an error."""
    _check_p.bind(jnp.asarray(status, INDEX_DTYPE), comm=i64(comm.py2f()))


def reduce_scatter_dense(s: SparseStream, *, part_capacity: int, status: jax.Array, comm: MPI.Comm, delta: float):
    """Sums range r of every rank's stream on rank r, as the dense slice of that range (DSAR's split
    phase). Returns (slice, whether SparCML's rule makes the sum dense, status, bytes sent).

    The segments travel as in :func:`reduce_scatter`; they are added straight into the dense
    slice instead of merged into a sorted stream (``part_capacity`` is not needed).
    """
    rank, parts = comm.Get_rank(), comm.Get_size()
    length = part_length(s.size, parts, rank)
    values, union, status, sent = _reduce_scatter_dense_p.bind(
        s.indices, s.values, s.nnz, status, length=i64(length), comm=i64(comm.py2f()), tag=i64(_TAG_BASE + 64),
        n=i64(s.size), delta=float(delta),
    )
    # Dense as the merged part would be: by SparCML's rule, or when it covers its range (also when empty).
    return values, (union >= dense_threshold(length, delta)) | (union == length), status, sent


def allgather_dense(values: jax.Array, *, size: int, status: jax.Array, comm: MPI.Comm):
    """Concatenates every rank's dense slice of its range (the DSAR allgather phase) into a dense
    stream: each slice is received in place in the result (MPI_Allgather, or MPI_Allgatherv when
    N % P != 0), with no staging buffer."""
    idx, val, status, sent = _allgather_dense_p.bind(values, status, size=i64(size), comm=i64(comm.py2f()))
    return SparseStream(idx, val, jnp.int32(size), size), status, sent


def allreduce_dense(s: SparseStream, *, comm: MPI.Comm) -> SparseStream:
    """MPI_Allreduce of the stream as a dense vector, densified straight into the result: the dense
    baseline, as a dense stream (the summary step has validated ``s``)."""
    idx, val = _allreduce_dense_p.bind(s.indices, s.values, s.nnz, size=i64(s.size), comm=i64(comm.py2f()))
    return SparseStream(idx, val, jnp.int32(s.size), s.size)
