"""mpi4jax transport: the operations of :class:`~sparcml_jax.comm.Transport` as mpi4jax ops.

mpi4jax has no variable-length messages, so every message carries its whole static capacity:
``[nnz, 0, indices..., bitcast(values)...]`` as one int32 buffer, or, for the exchanges of
recursive doubling and the ring, ``[nnz, 0]``, ``[indices...]`` and ``[values...]`` as three
messages: indices and values then go straight from and into XLA's buffers. (Packing the values
with the indices cost 3.8-4.1 ms against 2.2-2.4 ms at N = 2^22, 1 %, P = 4.) Once a stream's
capacity reaches the dense length, it travels as the dense vector instead (4 bytes per entry). On a
bfloat16 wire the values travel as bfloat16, two to an int32 slot (as uint16 in the three messages).
:func:`sparcml_jax.sparse_allreduce` runs the algorithms whose result is dense (the dense
allreduce and DSAR, ``ENGINE_ALGORITHMS``) on the native engine instead, on both MPI transports;
this transport carries SSAR, the ring, the allgather and the global top-k allreduces.

Static buffers cannot carry an abort, so a call first runs the native agreement step
(:func:`sparcml_jax.comm.native.agree`): ranks compare their static choices and validate their
streams there, and nothing can fail after it. XLA orders ops by their data only: a kernel that
validates this rank's own stream before any message (a densify, a split) takes the stream
through the agreement's result, so that it cannot fail here before the agreement has told every
rank; everything else follows a message, which comes after the agreement on the token chain.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import mpi4jax
from mpi4py import MPI

from sparcml_jax.comm import Combine, Quantize
from sparcml_jax.comm.static_buffers import HEADER, Part, StaticBuffers, densify, header, pack, unpack
from sparcml_jax.comm.topology import (allgather_capacities, block_pass, check_pairs, codes_segments,
                                       exchange_capacity, grown_capacity, longest_part, owned_slot, part_bounds,
                                       part_capacity, part_length, passed_capacity, peers_of, ring_segments,
                                       segment_slot, selected_capacity, slices_segments)
from sparcml_jax.kernels.merge import merge, merge_all
from sparcml_jax.stream import INDEX_DTYPE, VALUE_DTYPE, SparseStream, dense_stream, resize

NAME = "mpi4jax"
_TAG = 0x5CB0
_INDICES_TAG, _VALUES_TAG = 0x20, 0x40  # added to an exchange's tag for its indices and values


class Mpi4jaxTransport(StaticBuffers):
    """The mpi4jax :class:`~sparcml_jax.comm.Transport` of one rank; counts the bytes it sends."""

    name = NAME
    variable_length = False
    nonblocking = False

    def __init__(self, comm: MPI.Comm, delta: float, size: int, agreed: jax.Array, key: jax.Array | None = None,
                 value_bits: int = 32):
        """``agreed``: the agreement step's result (the largest nnz over ranks)."""
        self.comm, self.delta, self.size, self.value_bits = comm, delta, size, value_bits
        self.rank, self.nprocs = comm.Get_rank(), comm.Get_size()
        self._begin(agreed, key)

    # --------------------------------------------------------------------------- point to point

    def _transfer(self, s: SparseStream, dest: int, source: int, recv_size: int, recv_capacity: int):
        """Sends ``s`` to ``dest`` and receives a stream over ``recv_size`` entries of
        ``recv_capacity`` from ``source`` (-1: none). Returns (received or None, bytes sent).

        A stream travels as one compact message or as three (header, indices, values, so that
        these go straight from and into XLA's buffers); the two directions may differ, so the
        messages pair up as far as both go. Messages of one source and tag arrive in order, so
        every round can use the same tags."""
        if dest >= 0 and self._compact(s.size, s.capacity):
            sends = [(self._pack_compact(self._checked(s)), _TAG)]
        elif dest >= 0:
            sends = [(header(s.nnz), _TAG), (s.indices, _TAG + _INDICES_TAG), (self._wire_values(s.values),
                                                                               _TAG + _VALUES_TAG)]
        else:
            sends = []
        compact = self._compact(recv_size, recv_capacity)
        if source < 0:
            templates = []
        elif compact:
            templates = [(jnp.zeros((HEADER + self._compact_body(recv_size),), INDEX_DTYPE), _TAG)]
        else:
            templates = [(jnp.zeros((HEADER,), INDEX_DTYPE), _TAG),
                         (jnp.zeros((recv_capacity,), INDEX_DTYPE), _TAG + _INDICES_TAG),
                         (self._wire_values(jnp.zeros((recv_capacity,), VALUE_DTYPE)), _TAG + _VALUES_TAG)]
        received = []
        for i in range(max(len(sends), len(templates))):
            if i < len(sends) and i < len(templates):
                (payload, send_tag), (template, recv_tag) = sends[i], templates[i]
                received.append(mpi4jax.sendrecv(payload, template, source, dest, sendtag=send_tag,
                                                 recvtag=recv_tag, comm=self.comm))
            elif i < len(sends):
                mpi4jax.send(sends[i][0], dest, tag=sends[i][1], comm=self.comm)
            else:
                received.append(mpi4jax.recv(templates[i][0], source, tag=templates[i][1], comm=self.comm))
        sent = sum(payload.dtype.itemsize * payload.shape[0] for payload, _ in sends)
        if not received:
            return None, sent
        if compact:
            return self._unpack_compact(received[0], recv_size, recv_capacity), sent
        counts, indices, values = received
        return SparseStream(indices, self._from_wire_values(values), counts[0], recv_size), sent

    def _wire_values(self, values: jax.Array) -> jax.Array:
        """Values as a message carries them: float32, or bfloat16 bits (mpi4jax sends no bfloat16)."""
        if self.value_bits == 32:
            return values
        return jax.lax.bitcast_convert_type(values.astype(jnp.bfloat16), jnp.uint16)

    def _from_wire_values(self, received: jax.Array) -> jax.Array:
        if self.value_bits == 32:
            return received
        return jax.lax.bitcast_convert_type(received, jnp.bfloat16).astype(VALUE_DTYPE)

    def _combine(self, kept: SparseStream, got: SparseStream | None, capacity: int, combine: Combine) -> SparseStream:
        if got is None:
            return resize(kept, capacity)
        if combine == "replace":
            return resize(got, capacity)
        return merge(kept, got, delta=self.delta, capacity=capacity)

    def exchange(self, s: SparseStream, pairs: Sequence[tuple[int, int]], *, combine: Combine,
                 keep: bool = True) -> SparseStream:
        check_pairs(pairs, self.nprocs)
        dest, source = peers_of(pairs, self.rank)
        got, sent = self._transfer(s, dest, source, s.size, s.capacity)
        own = s if dest < 0 else self._as_sent(s) if keep else SparseStream.empty(s.size, s.capacity)
        out = self._combine(own, got, exchange_capacity(s.capacity, s.size, combine, self.delta), combine)
        self._after(dest >= 0 or source >= 0, out.is_dense, sent)
        return out

    def ring_pass(self, segments: list[SparseStream], *, send: int, into: int, combine: Combine) -> list[SparseStream]:
        p, r = self.nprocs, self.rank
        sending, target = ring_segments(r, p, send, into)
        kept = segments[target]
        got, sent = self._transfer(segments[sending], (r + 1) % p, (r - 1) % p, kept.size, kept.capacity)
        out = self._combine(kept, got, kept.capacity, combine)
        self._after(True, out.is_dense, sent)
        return [out if j == target else self._as_sent(seg) if j == sending else seg for j, seg in enumerate(segments)]

    # --------------------------------------------------------------------------- collectives

    def reduce_scatter(self, s: SparseStream, *, dense: bool = False, quantize: Quantize | None = None,
                       feedback: bool = False) -> Part | tuple[Part, SparseStream]:
        p, r = self.nprocs, self.rank
        if dense and quantize is not None and codes_segments(s.capacity, s.size, p):
            total, sent, error = self._coded_reduce_scatter(
                s, quantize, lambda rows: mpi4jax.alltoall(rows, comm=self.comm) if p > 1 else rows, r)
            self._after(True, jnp.bool_(True), sent)
            part = Part(None, total[:part_length(s.size, p, r)], s.capacity)
            return (part, dense_stream(error)) if feedback else part
        if feedback:  # nothing was coded: nothing lost
            return self.reduce_scatter(s, dense=dense), dense_stream(jnp.zeros((s.size,), VALUE_DTYPE))
        if dense and self.value_bits == 16 and slices_segments(s.capacity, s.size, p):
            total, sent = self._sliced_reduce_scatter(
                s, lambda rows: mpi4jax.alltoall(rows, comm=self.comm) if p > 1 else rows, r)
            self._after(True, jnp.bool_(True), sent)
            return Part(None, total[:part_length(s.size, p, r)], s.capacity)
        slot = segment_slot(s.capacity, s.size, p)
        sendbuf = self._segments(s, slot, value_bits=self.value_bits)
        received = mpi4jax.alltoall(sendbuf, comm=self.comm) if p > 1 else sendbuf
        length = part_length(s.size, p, r)
        acc = None
        for q in range(p):  # this rank's own segment as it is, the others' as they came
            exact = q == r and self.value_bits != 32
            idx, val, nnz = unpack(self._segments(s, slot)[r], slot) if exact else self._unpack(received[q], slot)
            seg = SparseStream(idx, val, nnz, length)
            acc = seg if acc is None else merge(acc, seg, delta=self.delta)
        part = resize(acc, part_capacity(s.capacity, s.size, p, r, self.delta))
        self._after(True, jnp.bool_(True) if dense else part.is_dense, 4 * sendbuf.shape[1] * (p - 1))
        if dense:
            return Part(None, densify(part), s.capacity)
        return Part(part, None, s.capacity)

    def _in_group(self, buf: jax.Array, members: list[int]) -> list[jax.Array]:
        """Every member's ``buf`` (static shape), in the order of ``members`` (this rank among
        them): a ring of sendrecvs, round d to the member d places on."""
        g, i = len(members), members.index(self.rank)
        out = [None] * g
        out[i] = buf
        for d in range(1, g):
            out[(i - d) % g] = mpi4jax.sendrecv(buf, buf, members[(i - d) % g], members[(i + d) % g],
                                                sendtag=_TAG, recvtag=_TAG, comm=self.comm)
        return out

    def _team(self, width: int) -> list[int]:
        first = self.rank - self.rank % width
        return list(range(first, first + width))

    def _column(self, width: int) -> list[int]:
        return list(range(self.rank % width, self.nprocs, width))

    def allgather(self, part: Part, *, dense: bool = False, quantize: Quantize | None = None,
                  width: int | None = None) -> SparseStream:
        p, n = self.nprocs, self.size
        if width is not None and width < p:  # this rank's team of width ranks gathers its parts
            slot, capacity = allgather_capacities(-1, part.slot, n, width, self.delta)
            mine = resize(part.stream, slot)
            buf = self._pack(mine)
            streams = []
            for q, got in enumerate(self._in_group(buf, self._team(width))):
                idx, val, count = self._unpack(got, slot)
                valid = jnp.arange(slot) < count
                streams.append(SparseStream(jnp.where(valid, idx + part_bounds(n, width, q)[0], n), val, count, n))
            if width == 1:  # a merge with nothing applies the dense switch all the same
                streams.append(SparseStream.empty(n, 0))
            result = resize(merge_all(streams, delta=self.delta), capacity)
            self._after(True, result.is_dense, 4 * buf.shape[0] * (width - 1))
            return result
        if quantize is not None or dense:
            values = part.values if part.values is not None else densify(part.stream)
            if quantize is not None:
                result, sent = self._quantized_allgather(values, quantize)
            else:
                slot = longest_part(n, p)
                buf = self._wire_values(jnp.concatenate([values, jnp.zeros((slot - values.shape[0],), VALUE_DTYPE)]))
                gathered = self._from_wire_values(mpi4jax.allgather(buf, comm=self.comm) if p > 1 else buf[None])
                result = jnp.concatenate([gathered[q, : part_length(n, p, q)] for q in range(p)])
                sent = buf.dtype.itemsize * slot * (p - 1)
            self._after(True, jnp.bool_(True), sent)
            return dense_stream(result)
        slot, capacity = allgather_capacities(part.source_capacity, part.slot, n, p, self.delta)
        mine = resize(part.stream, slot)
        buf = self._pack(mine)
        gathered = mpi4jax.allgather(buf, comm=self.comm) if p > 1 else buf[None]
        streams = []
        for q in range(p):  # each part re-based to global indices, its padding to n
            idx, val, count = self._unpack(gathered[q], slot)
            valid = jnp.arange(slot) < count
            start = 0 if part.regions else part_bounds(n, p, q)[0]
            streams.append(SparseStream(jnp.where(valid, idx + start, n), val, count, n))
        # The parts cover disjoint ranges in order, so merging them concatenates them and applies the
        # dense switch. Per-part XLA scatters made the algorithm 1.6-2.1x slower (P = 2, N = 2^22).
        if p == 1:  # a merge with nothing applies the dense switch all the same
            streams.append(SparseStream.empty(n, 0))
        result = resize(merge_all(streams, delta=self.delta), capacity)
        self._after(True, result.is_dense, 4 * buf.shape[0] * (p - 1))
        return result

    def _quantized_allgather(self, mine: jax.Array, q: Quantize):
        """QSGD-codes this rank's slice, allgathers the codes (static size) and decodes every slice:
        every rank decodes the same bytes, so all ranks hold identical results (SparCML §6)."""
        from sparcml_jax.kernels.qsgd import QuantizedVector, qsgd_dequantize, qsgd_quantize

        p, n = self.nprocs, self.size
        slot = longest_part(n, p)
        padded = jnp.concatenate([mine, jnp.zeros((slot - mine.shape[0],), mine.dtype)])
        coded = qsgd_quantize(padded, jax.random.fold_in(self.key, self.rank), bits=q.bits, bucket_size=q.bucket_size,
                              scale=q.scale)
        if p > 1:
            packed = mpi4jax.allgather(coded.data, comm=self.comm)
            scales = mpi4jax.allgather(coded.scales, comm=self.comm)
        else:
            packed, scales = coded.data[None], coded.scales[None]
        pieces = []
        for r in range(p):
            decoded = qsgd_dequantize(QuantizedVector(packed[r], scales[r], coded.size, coded.bits, coded.bucket_size,
                                                      coded.scale))
            pieces.append(decoded[: part_length(n, p, r)])
        return jnp.concatenate(pieces), (coded.data.size + 4 * coded.scales.size) * (p - 1)

    def allreduce(self, s: SparseStream) -> SparseStream:
        if self.value_bits != 32:
            raise ValueError("MPI cannot sum bfloat16: the dense definition runs DSAR's phases instead")
        p = self.nprocs
        out = dense_stream(mpi4jax.allreduce(densify(self._checked(s)), op=MPI.SUM, comm=self.comm))
        # Volume of a reduce-scatter + allgather (Rabenseifner / ring), which MPICH uses for large vectors.
        self._after(True, jnp.bool_(True), 2 * (p - 1) / p * 4 * s.size)
        return out

    def gather(self, s: SparseStream, *, width: int | None = None) -> SparseStream:
        p = self.nprocs
        if width is not None and width < p:  # the ranks at this rank's position of every team
            g, cap = p // width, s.capacity
            buf = pack(s.indices, s.values, s.nnz)
            streams = [SparseStream(*unpack(got, cap)[:2], unpack(got, cap)[2], s.size)
                       for got in self._in_group(buf, self._column(width))]
            result = resize(merge_all(streams, delta=self.delta), grown_capacity(cap, s.size, g, self.delta))
            self._after(True, result.is_dense, 4 * buf.shape[0] * (g - 1))
            return result
        buf = pack(s.indices, s.values, s.nnz)
        gathered = mpi4jax.allgather(buf, comm=self.comm) if p > 1 else buf[None]
        cap = s.capacity
        streams = [SparseStream(gathered[q, HEADER:HEADER + cap],
                                jax.lax.bitcast_convert_type(gathered[q, HEADER + cap:], VALUE_DTYPE),
                                gathered[q, 0], s.size) for q in range(p)]
        result = resize(merge_all(streams, delta=self.delta), grown_capacity(cap, s.size, p, self.delta))
        self._after(True, result.is_dense, 4 * buf.shape[0] * (p - 1))
        return result

    # --------------------------------------------------------------------------- global top-k

    def pass_blocks(self, blocks: list[SparseStream], *, distance: int, count: int,
                    budgets: Sequence[int] | None = None) -> list[SparseStream]:
        out = list(blocks)
        dest, source, moves = block_pass(self.rank, len(blocks), distance, count)
        for send, into in moves:
            if budgets is None:  # handed over whole; what arrives has the capacity of every rank's unsent blocks
                kept, out[send] = out[send], SparseStream.empty(out[send].size, out[send].capacity)
                arriving = kept.capacity
            else:
                kept, out[send] = self.select(out[send], budgets[send])
                arriving = selected_capacity(budgets[into], out[into].capacity, out[into].size)
            target = out[into]
            got, sent = self._transfer(kept, dest, source, target.size, arriving)
            capacity = passed_capacity(target.capacity, arriving, target.size, budgets is None)
            # An Ok-Topk region stays pairs: its entries lie in a sub-range (delta 4: never dense).
            out[into] = merge(target, got, delta=4.0 if budgets is None else self.delta, capacity=capacity)
            self._after(True, out[into].is_dense, sent)
        return out

    def select_owned(self, blocks: list[SparseStream], budgets: Sequence[int], *,
                     threshold: jax.Array | None = None) -> tuple[Part, list[SparseStream]]:
        width, out = len(blocks), list(blocks)
        own = self.rank % width
        kept, out[own] = self.select(out[own], budgets[own], threshold=threshold)
        slot = owned_slot(budgets, [(b.capacity, b.size) for b in blocks])
        # A block over the whole vector is a region of split_regions (or SparDL's only nonempty range,
        # which starts at 0 too): its indices need no re-basing.
        return Part(kept, None, -1, slot, regions=kept.size == self.size), out

    def reselect_across_teams(self, part: Part, budgets: Sequence[int]) -> Part:
        width = len(budgets)
        kept, _ = self.select(self.gather(part.stream, width=width), budgets[self.rank % width])
        return Part(kept, None, -1, part.slot)

