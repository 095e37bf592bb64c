"""XLA transport: the operations of :class:`~sparcml_jax.comm.Transport` as XLA's own collectives.

It runs inside ``jax.shard_map`` (or ``pmap``) over a mesh axis, on any platform: every device of
the axis runs the same program, its rank is ``jax.lax.axis_index`` (a traced value) and every
message is a collective over the axis with static shapes:

- rounds whose partners are fixed (recursive doubling, the ring, a tree, SparDL's and Ok-Topk's
  rounds, a team's members) are static permutations: ``jax.lax.ppermute``;
- the reduce-scatter into ranges is ``jax.lax.all_to_all``, the allgathers ``jax.lax.all_gather``
  and the dense sum ``jax.lax.psum``.

Like the mpi4jax transport, a message carries its whole static capacity. What differs between
ranks is which range they handle, so the segments of a stream (a ring's, SparDL's blocks,
Ok-Topk's regions) are kept in the order of their distance from the rank's own: slot i holds
range (position + i) mod parts, where position is the rank's place in its team. A rank's sends
and receives are then the same slots on every rank, and each slot's stream spans the longest
range. Those streams stay sorted pairs; SparCML's dense switch is taken on streams over the
whole vector (the exchanges' and the result).
"""

from __future__ import annotations

from typing import Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sparcml_jax.comm import Combine, Quantize
from sparcml_jax.comm.static_buffers import Part, StaticBuffers, densify, pack, unpack
from sparcml_jax.comm.topology import (allgather_capacities, block_pass, check_pairs, codes_segments,
                                       concatenated_capacity, exchange_capacity, grown_capacity,
                                       largest_part_capacity, longest_part, owned_slot, part_bounds, part_length,
                                       passed_capacity, segment_capacities, segment_slot, slices_segments)
from sparcml_jax.kernels.merge import merge, merge_all
from sparcml_jax.kernels.partition import partition_bounds
from sparcml_jax.stream import INDEX_DTYPE, VALUE_DTYPE, SparseStream, dense_stream, resize

NAME = "xla"
_PAIRS_ONLY = 4.0  # a delta whose dense threshold (2 n) no stream reaches


def _table(values: Sequence[int], index: jax.Array) -> jax.Array:
    return jnp.asarray(np.asarray(values, np.int32))[index]


def _universe(s: SparseStream, size: int) -> SparseStream:
    """``s``'s pairs as a stream over ``size`` entries (its padding marked anew)."""
    valid = jnp.arange(s.capacity) < s.nnz
    return SparseStream(jnp.where(valid, s.indices, size), jnp.where(valid, s.values, 0.0), s.nnz, size)


def _unpacked(buf: jax.Array, capacity: int, size: int, value_bits: int = 32) -> SparseStream:
    if capacity == 0:  # no slices of zero length out of a collective's result (XLA:CPU then loses FFI targets)
        return SparseStream.empty(size, 0)
    idx, val, nnz = unpack(buf, capacity, value_bits)
    return _universe(SparseStream(idx, val, nnz, size), size)


def agree(s: SparseStream, axis_name: Hashable, name: str = "stream") -> jax.Array:
    """Validates this device's ``s`` and shares the verdict over the axis, so that every device
    raises the same error if any device's stream is invalid, before a message carries one (an
    error on one device alone would leave the others waiting in a collective when the axis
    spans processes). Returns what the transport's streams pass through (:class:`XlaTransport`)."""
    if s.dense_by_construction:  # no indices to check; any other count than size does not fit
        bad = jnp.zeros((1,), bool)
        misfit = s.nnz != s.size
    else:
        valid = jnp.arange(s.capacity) < s.nnz
        inside = (s.indices >= 0) & (s.indices < s.size)
        rising = jnp.concatenate([jnp.ones((1,), bool), s.indices[1:] > s.indices[:-1]])[: s.capacity]
        bad = valid & ~(inside & rising)
        misfit = (s.nnz < 0) | (s.nnz > s.capacity)
    first_bad = jnp.argmax(bad).astype(INDEX_DTYPE)
    code = jnp.where(misfit, 1, jnp.where(jnp.any(bad), 2, 0)).astype(INDEX_DTYPE)
    report = jax.lax.all_gather(jnp.stack([code, s.nnz.astype(INDEX_DTYPE), first_bad]), axis_name)

    def check(report: np.ndarray) -> np.ndarray:
        for device, (code, nnz, position) in enumerate(np.asarray(report).reshape(-1, 3)):
            if code == 1:
                raise ValueError(f"{name} on device {device} of axis {axis_name!r}: nnz={nnz} does not fit its "
                                 f"capacity {s.capacity} (from_dense, coalesce and merge return the true count when "
                                 "it does not fit); pass a larger capacity where the stream is built")
            if code == 2:
                raise ValueError(f"{name} on device {device} of axis {axis_name!r}: indices must be strictly "
                                 f"increasing in [0, {s.size}) for the first nnz={nnz} pairs, not at position "
                                 f"{position}; build streams with SparseStream.from_dense, coalesce or topk")
        return np.zeros((), np.int32)

    return jax.pure_callback(check, jax.ShapeDtypeStruct((), INDEX_DTYPE), report)


def _rebased(buf: jax.Array, slot: int, size: int, start, value_bits: int = 32) -> SparseStream:
    """A part that travelled in ``slot`` pairs, its indices moved on by ``start``, over ``size``."""
    if slot == 0:
        return SparseStream.empty(size, 0)
    idx, val, count = unpack(buf, slot, value_bits)
    return SparseStream(jnp.where(jnp.arange(slot) < count, idx + start, size), val, count, size)


class XlaTransport(StaticBuffers):
    """The :class:`~sparcml_jax.comm.Transport` of one device of a mesh axis; counts the bytes it
    sends. ``checked`` is the agreement's result (:func:`agree`), which every stream this rank
    validates passes through."""

    name = NAME
    variable_length = False
    nonblocking = False

    def __init__(self, axis_name: Hashable, nprocs: int, delta: float, size: int, checked: jax.Array,
                 key: jax.Array | None = None, value_bits: int = 32):
        self.axis, self.nprocs, self.delta, self.size = axis_name, nprocs, delta, size
        self.value_bits = value_bits
        self.axes = frozenset([axis_name])
        self.rank = jax.lax.axis_index(axis_name)
        self._begin(checked, key)

    def _delta_for(self, s: SparseStream) -> float:
        """SparCML's switch on streams over the whole vector; a slot's stream stays pairs."""
        return self.delta if s.size == self.size else _PAIRS_ONLY

    def _position(self, parts: int) -> jax.Array:
        return self.rank % parts

    # --------------------------------------------------------------------------- messages

    def _permute(self, s: SparseStream, perm: list[tuple[int, int]]) -> tuple[SparseStream, int]:
        """Every (source, dest) of ``perm``: ``source`` sends its ``s`` to ``dest``; (what this
        rank receives, an empty stream if nothing, and the bytes of one message)."""
        if s.size == self.size and self._compact(s.size, s.capacity):
            buf = self._pack_compact(s)
            received = jax.lax.ppermute(buf, self.axis, perm)
            got = self._unpack_compact(received, s.size, s.capacity)
        else:
            buf = self._pack(s)
            received = jax.lax.ppermute(buf, self.axis, perm)
            got = _unpacked(received, s.capacity, s.size, self.value_bits)
        receives = _table([any(d == r for _, d in perm) for r in range(self.nprocs)], self.rank).astype(bool)
        empty = SparseStream.empty(s.size, s.capacity)
        return jax.tree.map(lambda a, b: jnp.where(receives, a, b), got, empty), 4 * buf.shape[0]

    def _in_groups(self, buf: jax.Array, groups: list[list[int]]) -> list[jax.Array]:
        """Every member's ``buf`` within each group (equal sizes): entry d is the buffer of the
        member d places before this rank in its group (d = 0: its own)."""
        out = [buf]
        for d in range(1, len(groups[0])):
            perm = [(g[i], g[(i + d) % len(g)]) for g in groups for i in range(len(g))]
            out.append(jax.lax.ppermute(buf, self.axis, perm))
        return out

    def exchange(self, s: SparseStream, pairs: Sequence[tuple[int, int]], *, combine: Combine,
                 keep: bool = True) -> SparseStream:
        check_pairs(pairs, self.nprocs)
        s = self._checked(s)
        got, message = self._permute(s, list(pairs))
        member = lambda ranks: _table([r in ranks for r in range(self.nprocs)], self.rank).astype(bool)  # noqa: E731
        sends, receives = member({a for a, _ in pairs}), member({b for _, b in pairs})
        kept = SparseStream.empty(s.size, s.capacity) if not keep else self._as_sent(s)
        own = jax.tree.map(lambda e, x: jnp.where(sends, e, x), kept, s)
        capacity = exchange_capacity(s.capacity, s.size, combine, self.delta)
        combined = (resize(got, capacity) if combine == "replace"
                    else merge(own, got, delta=self._delta_for(s), capacity=capacity))
        out = jax.tree.map(lambda c, o: jnp.where(receives, c, o), combined, resize(own, capacity))
        self._after(sends | receives, out.is_dense, jnp.where(sends, message, 0))
        return out

    def ring_pass(self, segments: list[SparseStream], *, send: int, into: int, combine: Combine) -> list[SparseStream]:
        p = self.nprocs
        sending, target = send % p, into % p  # slots: the same on every rank
        kept = segments[target]
        got, message = self._permute(segments[sending], [(q, (q + 1) % p) for q in range(p)])
        out = (resize(got, kept.capacity) if combine == "replace"
               else merge(kept, got, delta=_PAIRS_ONLY, capacity=kept.capacity))
        self._after(jnp.bool_(True), jnp.bool_(False), message)
        return [out if j == target else self._as_sent(seg) if j == sending else seg for j, seg in enumerate(segments)]

    # --------------------------------------------------------------------------- collectives

    def reduce_scatter(self, s: SparseStream, *, dense: bool = False, quantize: Quantize | None = None,
                       feedback: bool = False) -> Part | tuple[Part, SparseStream]:
        p = self.nprocs
        if dense and quantize is not None and codes_segments(s.capacity, s.size, p):
            total, sent, error = self._coded_reduce_scatter(
                s, quantize, lambda rows: jax.lax.all_to_all(rows, self.axis, 0, 0) if p > 1 else rows, self.rank)
            self._after(jnp.bool_(True), jnp.bool_(True), sent)
            return (Part(None, total, s.capacity), dense_stream(error)) if feedback else Part(None, total, s.capacity)
        if feedback:  # nothing was coded: nothing lost
            return self.reduce_scatter(s, dense=dense), dense_stream(jnp.zeros((s.size,), VALUE_DTYPE))
        if dense and self.value_bits == 16 and slices_segments(s.capacity, s.size, p):
            total, sent = self._sliced_reduce_scatter(
                s, lambda rows: jax.lax.all_to_all(rows, self.axis, 0, 0) if p > 1 else rows, self.rank)
            self._after(jnp.bool_(True), jnp.bool_(True), sent)
            return Part(None, total, s.capacity)
        slot = segment_slot(s.capacity, s.size, p)
        sendbuf = self._segments(self._checked(s), slot, value_bits=self.value_bits)
        received = jax.lax.all_to_all(sendbuf, self.axis, 0, 0) if p > 1 else sendbuf
        longest = longest_part(s.size, p)
        streams = [_unpacked(received[q], slot, longest, self.value_bits) for q in range(p)]
        if self.value_bits != 32:  # a rank adds its own segment as it is, the others' as they came
            own = _unpacked(self._segments(self._checked(s), slot)[self.rank], slot, longest)
            streams = [jax.tree.map(lambda mine, got: jnp.where(q == self.rank, mine, got), own, streams[q])
                       for q in range(p)]
        capacity = min(largest_part_capacity(s.capacity, s.size, p, self.delta), longest)
        part = resize(merge_all(streams + [SparseStream.empty(longest, 0)] * (p == 1), delta=_PAIRS_ONLY), capacity)
        self._after(jnp.bool_(True), jnp.bool_(dense), 4 * sendbuf.shape[1] * (p - 1))
        if dense:
            return Part(None, densify(part), s.capacity)
        return Part(part, None, s.capacity)

    def allgather(self, part: Part, *, dense: bool = False, quantize: Quantize | None = None,
                  width: int | None = None) -> SparseStream:
        p, n = self.nprocs, self.size
        if width is not None and width < p:  # this rank's team of width ranks gathers its parts
            slot, capacity = allgather_capacities(-1, part.slot, n, width, self.delta)
            mine = resize(part.stream, slot)
            buf = self._pack(mine)
            teams = [list(range(t, t + width)) for t in range(0, p, width)]
            position = self._position(width)
            streams = []
            for d, got in enumerate(self._in_groups(buf, teams)):
                start = 0 if part.regions else _table([part_bounds(n, width, q)[0] for q in range(width)],
                                                      (position - d) % width)
                streams.append(_rebased(got, slot, n, start, self.value_bits))
            result = resize(merge_all(streams + [SparseStream.empty(n, 0)] * (width == 1), delta=self.delta),
                            capacity)
            self._after(jnp.bool_(True), result.is_dense, 4 * buf.shape[0] * (width - 1))
            return result
        if quantize is not None or dense:
            longest = longest_part(n, p)
            values = part.values if part.values is not None else densify(part.stream)
            values = jnp.concatenate([values, jnp.zeros((longest - values.shape[0],), VALUE_DTYPE)])
            if quantize is not None:
                result, sent = self._quantized_allgather(values, quantize)
            else:
                wire = values.astype(jnp.bfloat16) if self.value_bits == 16 else values
                gathered = (jax.lax.all_gather(wire, self.axis) if p > 1 else wire[None]).astype(VALUE_DTYPE)
                result = jnp.concatenate([gathered[q, : part_length(n, p, q)] for q in range(p)])
                sent = self.value_bits // 8 * longest * (p - 1)
            self._after(jnp.bool_(True), jnp.bool_(True), sent)
            return dense_stream(result)
        slot, capacity = allgather_capacities(part.source_capacity, part.slot, n, p, self.delta)
        mine = resize(part.stream, slot)
        buf = self._pack(mine)
        gathered = jax.lax.all_gather(buf, self.axis) if p > 1 else buf[None]
        streams = []
        for q in range(p):  # each part re-based to global indices, its padding to n
            streams.append(_rebased(gathered[q], slot, n, 0 if part.regions else part_bounds(n, p, q)[0],
                                    self.value_bits))
        result = resize(merge_all(streams + [SparseStream.empty(n, 0)] * (p == 1), delta=self.delta), capacity)
        self._after(jnp.bool_(True), result.is_dense, 4 * buf.shape[0] * (p - 1))
        return result

    def _quantized_allgather(self, mine: jax.Array, q: Quantize):
        """QSGD codes of this rank's slice, allgathered; every rank decodes the same bytes, so every
        rank holds the same result (SparCML §6)."""
        from sparcml_jax.kernels.qsgd import QuantizedVector, qsgd_dequantize, qsgd_quantize

        p, n = self.nprocs, self.size
        coded = qsgd_quantize(mine, jax.random.fold_in(self.key, self.rank), bits=q.bits, bucket_size=q.bucket_size,
                              scale=q.scale)
        if p > 1:
            packed, scales = jax.lax.all_gather(coded.data, self.axis), jax.lax.all_gather(coded.scales, self.axis)
        else:
            packed, scales = coded.data[None], coded.scales[None]
        pieces = [qsgd_dequantize(QuantizedVector(packed[r], scales[r], coded.size, coded.bits, coded.bucket_size,
                                                  coded.scale))[: part_length(n, p, r)] for r in range(p)]
        return jnp.concatenate(pieces), (coded.data.size + 4 * coded.scales.size) * (p - 1)

    def allreduce(self, s: SparseStream) -> SparseStream:
        if self.value_bits != 32:
            raise ValueError("psum would sum bfloat16 in bfloat16: the dense definition runs DSAR's phases instead")
        p = self.nprocs
        out = dense_stream(jax.lax.psum(densify(self._checked(s)), self.axis))
        self._after(jnp.bool_(True), jnp.bool_(True), 2 * (p - 1) / p * 4 * s.size)
        return out

    def gather(self, s: SparseStream, *, width: int | None = None) -> SparseStream:
        p = self.nprocs
        s = self._checked(s)
        buf = pack(s.indices, s.values, s.nnz)
        if width is not None and width < p:  # the ranks at this rank's position of every team
            received = self._in_groups(buf, [list(range(c, p, width)) for c in range(width)])
            fan_in = p // width
        else:
            gathered = jax.lax.all_gather(buf, self.axis) if p > 1 else buf[None]
            received, fan_in = [gathered[q] for q in range(p)], p
        streams = [_unpacked(got, s.capacity, s.size) for got in received]
        delta = self._delta_for(s)
        result = resize(merge_all(streams + [SparseStream.empty(s.size, 0)] * (fan_in == 1), delta=delta),
                        min(grown_capacity(s.capacity, s.size, fan_in, delta), s.size))
        self._after(jnp.bool_(True), result.is_dense, 4 * buf.shape[0] * (fan_in - 1))
        return result

    # --------------------------------------------------------------------------- segments, in slots

    def split(self, s: SparseStream, *, fan_in: int = 1, parts: int | None = None) -> list[SparseStream]:
        parts = self.nprocs if parts is None else parts
        slot = segment_slot(s.capacity, s.size, parts)
        rows = self._segments(self._checked(s), slot, parts)
        longest = longest_part(s.size, parts)
        capacity = min(max(segment_capacities(s.capacity, s.size, parts, fan_in, self.delta)), longest)
        mine = (self._position(parts) + jnp.arange(parts)) % parts
        rows = rows[mine]  # slot i: range (position + i) mod parts
        return [resize(_unpacked(rows[i], slot, longest), capacity) for i in range(parts)]

    def concat(self, segments: list[SparseStream]) -> SparseStream:
        parts, n = len(segments), self.size
        starts = partition_bounds(n, parts)[:-1]
        position = self._position(parts)
        streams = []
        for i, seg in enumerate(segments):
            valid = jnp.arange(seg.capacity) < seg.nnz
            start = _table(starts, (position + i) % parts)
            streams.append(SparseStream(jnp.where(valid, seg.indices + start, n), seg.values, seg.nnz, n))
        capacity = concatenated_capacity([seg.capacity for seg in segments], n, self.delta)
        return resize(merge_all(streams + [SparseStream.empty(n, 0)] * (parts == 1), delta=self.delta), capacity)

    def split_regions(self, s: SparseStream, starts: jax.Array) -> list[SparseStream]:
        regions = super().split_regions(s, starts)
        stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *regions)
        mine = (self.rank + jnp.arange(self.nprocs)) % self.nprocs
        return [jax.tree.map(lambda leaf: leaf[mine[i]], stacked) for i in range(self.nprocs)]

    # --------------------------------------------------------------------------- global top-k

    def _budget(self, budgets: Sequence[int], block: jax.Array) -> jax.Array | None:
        """This rank's budget for ``block``, a run-time value when the budgets differ."""
        return None if len(set(budgets)) == 1 else _table(budgets, block)

    def pass_blocks(self, blocks: list[SparseStream], *, distance: int, count: int,
                    budgets: Sequence[int] | None = None) -> list[SparseStream]:
        width, out = len(blocks), list(blocks)
        perm = [(r, block_pass(r, width, distance, count)[0]) for r in range(self.nprocs)]
        position = self._position(width)
        for j in range(count):
            send, into = (distance + j) % width, j % width  # slots
            if budgets is None:  # handed over whole
                kept, out[send] = out[send], SparseStream.empty(out[send].size, out[send].capacity)
            else:
                kept, out[send] = self.select(out[send], max(budgets), limit=self._budget(budgets, (position + send) % width))
            target = out[into]
            got, message = self._permute(kept, perm)
            capacity = passed_capacity(target.capacity, kept.capacity, target.size, budgets is None)
            out[into] = merge(target, resize(got, kept.capacity), delta=_PAIRS_ONLY, capacity=capacity)
            self._after(jnp.bool_(True), jnp.bool_(False), message)
        return out

    def select_owned(self, blocks: list[SparseStream], budgets: Sequence[int], *,
                     threshold: jax.Array | None = None) -> tuple[Part, list[SparseStream]]:
        width, out = len(blocks), list(blocks)
        limit = None if threshold is not None else self._budget(budgets, self._position(width))
        kept, out[0] = self.select(out[0], max(budgets), threshold=threshold, limit=limit)  # slot 0: its own block
        slot = owned_slot(budgets, [(b.capacity, b.size) for b in blocks])
        return Part(kept, None, -1, slot, regions=kept.size == self.size), out

    def reselect_across_teams(self, part: Part, budgets: Sequence[int]) -> Part:
        width = len(budgets)
        summed = self.gather(part.stream, width=width)
        kept, _ = self.select(summed, max(budgets), limit=self._budget(budgets, self._position(width)))
        return Part(kept, None, -1, part.slot)

