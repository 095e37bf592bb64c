"""Static buffers: the local operations of the transports whose messages have fixed sizes.

The mpi4jax transport and the XLA transport send whole static buffers, so between messages
their streams are ``SparseStream`` values of static capacity, and what they do to them on one
rank (cut a stream into ranges, select its top entries, join segments, form the residual) is
the same. This base class holds those operations; the transports add the messages.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from sparcml_jax.comm.topology import (concatenated_capacity, longest_part, part_bounds, part_length,
                                       segment_capacities, segment_slot, selected_capacity)
from sparcml_jax.kernels._common import cond_varying
from sparcml_jax.kernels.merge import merge, merge_all
from sparcml_jax.kernels.partition import partition_bounds, to_dense
from sparcml_jax.kernels.topk import topk
from sparcml_jax.stream import (INDEX_DTYPE, VALUE_DTYPE, SparseStream, dense_stream, dense_threshold, resize,
                                with_indices)

HEADER = 2


@dataclasses.dataclass(frozen=True)
class Part:
    """This rank's range of a reduce-scatter: a stream (local indices), or dense ``values``."""

    stream: SparseStream | None
    values: jax.Array | None
    source_capacity: int
    slot: int = -1  # a selected part (source_capacity -1): the pairs every rank's part has room for
    regions: bool = False  # a part of run-time regions: its indices are over the whole vector


def header(nnz) -> jax.Array:
    return jnp.stack([jnp.asarray(nnz, INDEX_DTYPE), jnp.zeros((), INDEX_DTYPE)])


def value_slots(count: int, value_bits: int = 32) -> int:
    """int32 slots that ``count`` values take on the wire: one each, or two bfloat16 per slot."""
    return count if value_bits == 32 else -(-count // 2)


def to_slots(val: jax.Array, value_bits: int = 32) -> jax.Array:
    """Values as int32 slots: float32 bits, or pairs of bfloat16 (rounded to nearest even)."""
    if value_bits == 32:
        return jax.lax.bitcast_convert_type(val, INDEX_DTYPE)
    half = jnp.pad(val.astype(jnp.bfloat16), (0, val.shape[0] % 2))
    return jax.lax.bitcast_convert_type(half.reshape(-1, 2), INDEX_DTYPE)


def from_slots(slots: jax.Array, count: int, value_bits: int = 32) -> jax.Array:
    """The ``count`` float32 values of :func:`to_slots`' slots."""
    if value_bits == 32:
        return jax.lax.bitcast_convert_type(slots[:count], VALUE_DTYPE)
    return jax.lax.bitcast_convert_type(slots, jnp.bfloat16).reshape(-1)[:count].astype(VALUE_DTYPE)


def pack(idx: jax.Array, val: jax.Array, nnz, value_bits: int = 32) -> jax.Array:
    return jnp.concatenate([header(nnz), idx, to_slots(val, value_bits)])


def unpack(buf: jax.Array, capacity: int, value_bits: int = 32):
    idx = buf[HEADER:HEADER + capacity]
    return idx, from_slots(buf[HEADER + capacity:], capacity, value_bits), buf[0]


def densify(s: SparseStream) -> jax.Array:
    return to_dense(s)


class StaticBuffers:
    """The local operations of a static-buffer transport (``delta``, ``size`` and ``nprocs`` set
    by the subclass)."""

    delta: float
    size: int
    nprocs: int
    axes: frozenset = frozenset()  # the mesh axes its values vary over (the XLA transport's)
    value_bits: int = 32  # of a value in a message: 16 packs two bfloat16 values per int32 slot

    def _pack(self, s: SparseStream) -> jax.Array:
        """A stream's message: [nnz, 0, indices, values], its values as the wire carries them."""
        return pack(s.indices, s.values, s.nnz, self.value_bits)

    def _unpack(self, buf: jax.Array, capacity: int):
        return unpack(buf, capacity, self.value_bits)

    def as_result(self, s: SparseStream) -> SparseStream:
        """An algorithm's result, as every rank holds it: on a bfloat16 wire its values rounded
        (as the native engine ends), since a rank that handed the total on holds it as sent."""
        return self._as_sent(s)

    def _as_sent(self, s: SparseStream) -> SparseStream:
        """``s`` as its message delivers it. On a bfloat16 wire a rank keeps what it sends in
        that form, so that every rank that adds the same streams holds the same sum."""
        if self.value_bits == 32:
            return s
        return dataclasses.replace(s, values=from_slots(to_slots(s.values, 16), s.capacity, 16))

    def _cond(self, pred, true_fun, false_fun, *operands):
        return cond_varying(pred, true_fun, false_fun, *operands, axes=self.axes)

    def _begin(self, agreed: jax.Array, key: jax.Array | None) -> None:
        """``agreed``: the agreement step's result, which every stream this rank validates passes through."""
        self.agreed, self.key = agreed, key
        self.sent = jnp.float32(0)
        self.dense_round = jnp.int32(-1)
        self._round = 0

    def _checked(self, s: SparseStream) -> SparseStream:
        """``s`` through the agreement's result (the condition never holds: no count is negative)."""
        return SparseStream(s.indices, s.values, jnp.where(self.agreed < 0, 0, s.nnz), s.size)

    def _after(self, took_part, is_dense, sent) -> None:
        """Counts a round: its bytes, and whether this rank's data turned dense in it."""
        first = (self.dense_round < 0) & took_part & is_dense
        self.dense_round = jnp.where(first, jnp.int32(self._round), self.dense_round)
        self.sent = self.sent + jnp.asarray(sent, jnp.float32)
        self._round += 1

    def _compact(self, size: int, capacity: int) -> bool:
        """Once the buffers can hold the dense vector, a message of n int32 slots (3n / 4 on a
        bfloat16 wire) carries either the dense values or, below SparCML's threshold, the (at most
        n // 2) pairs: 4 bytes per entry instead of 8, and the switch still follows the actual count."""
        return capacity >= size and dense_threshold(size, self.delta) - 1 <= size // 2

    def _compact_body(self, n: int) -> int:
        half = n // 2
        return max(half + value_slots(half, self.value_bits), value_slots(n, self.value_bits))

    def _pack_compact(self, s: SparseStream) -> jax.Array:
        """[nnz, 0, body]: the dense values when nnz reaches the threshold, else the pairs."""
        n, half, body_length = s.size, s.size // 2, self._compact_body(s.size)
        go_dense = s.nnz >= dense_threshold(n, self.delta)
        fill = lambda slots: jnp.pad(slots, (0, body_length - slots.shape[0]))  # noqa: E731
        pairs = fill(jnp.concatenate([s.indices[:half], to_slots(s.values[:half], self.value_bits)]))
        dense = fill(to_slots(densify(s), self.value_bits))
        body = self._cond(go_dense, lambda: dense, lambda: pairs)
        nnz = jnp.where(go_dense, n, s.nnz).astype(INDEX_DTYPE)
        return jnp.concatenate([header(nnz), body])

    def _unpack_compact(self, buf: jax.Array, n: int, capacity: int) -> SparseStream:
        half, bits = n // 2, self.value_bits
        nnz, body = buf[0], buf[HEADER:]
        dense = resize(with_indices(dense_stream(from_slots(body[:value_slots(n, bits)], n, bits))), capacity)
        pairs = resize(SparseStream(body[:half], from_slots(body[half:half + value_slots(half, bits)], half, bits),
                                    nnz, n), capacity)
        return jax.tree.map(lambda d, p: jnp.where(nnz == n, d, p), dense, pairs)

    def _segments(self, s: SparseStream, slot: int, parts: int | None = None, value_bits: int = 32) -> jax.Array:
        """[parts, header + slot + value slots]: the pairs of each of ``parts`` ranges (default P),
        re-based to the range's start, their values packed as ``value_bits`` (a message's)."""
        parts = self.nprocs if parts is None else parts
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
            rows.append(pack(jnp.where(valid, idx, part_length(s.size, parts, r)), jnp.where(valid, val, 0.0), count,
                             value_bits))
        return jnp.stack(rows)

    def _coded_reduce_scatter(self, s: SparseStream, q, all_to_all, rank) -> tuple[jax.Array, int, jax.Array]:
        """(The dense sum of range ``rank``, zero-padded to the longest range; bytes sent; this
        rank's coding error over the whole vector.) Every segment travels as its QSGD codes except
        this rank's own, and the sum is float32 in rank order, as the native engine's.
        ``all_to_all`` exchanges rows [P, ...] (row r to rank r)."""
        from sparcml_jax.kernels.qsgd import QuantizedVector, key_words, qsgd_dequantize, qsgd_quantize, segment_key

        p, n = self.nprocs, s.size
        longest = longest_part(s.size, p)
        values = densify(self._checked(s))
        slices = jnp.stack([jnp.pad(values[lo:hi], (0, longest - (hi - lo)))
                            for lo, hi in (part_bounds(n, p, r) for r in range(p))])
        words = key_words(jax.random.fold_in(self.key, rank))
        coded = [qsgd_quantize(slices[r], segment_key(words, r), bits=q.bits, bucket_size=q.bucket_size,
                               scale=q.scale) for r in range(p)]
        packed = all_to_all(jnp.stack([c.data for c in coded]))
        scales = all_to_all(jnp.stack([c.scales for c in coded]))
        own = slices[rank]
        total = jnp.zeros((longest,), VALUE_DTYPE)
        for source in range(p):
            decoded = qsgd_dequantize(QuantizedVector(packed[source], scales[source], longest, q.bits, q.bucket_size,
                                                      q.scale))
            total = total + jnp.where(source == rank, own, decoded)
        lost = [jnp.where(r == rank, 0.0, slices[r] - qsgd_dequantize(c))[:hi - lo]
                for r, (c, (lo, hi)) in enumerate(zip(coded, (part_bounds(n, p, r) for r in range(p))))]
        return total, (coded[0].data.size + 4 * coded[0].scales.size) * (p - 1), jnp.concatenate(lost)

    def _sliced_reduce_scatter(self, s: SparseStream, all_to_all, rank) -> tuple[jax.Array, int]:
        """(The dense sum of range ``rank``, zero-padded to the longest range; bytes sent.) On a
        bfloat16 wire every range travels as its dense bfloat16 values, and the owner adds the
        others' to its own in rank order in float32, as the native engine does. ``all_to_all``
        exchanges rows [P, ...] (row r to rank r)."""
        p, n = self.nprocs, s.size
        longest = longest_part(n, p)
        values = densify(self._checked(s))
        slices = jnp.stack([jnp.pad(values[lo:hi], (0, longest - (hi - lo)))
                            for lo, hi in (part_bounds(n, p, r) for r in range(p))])
        bits = jax.lax.bitcast_convert_type(slices.astype(jnp.bfloat16), jnp.uint16)
        received = jax.lax.bitcast_convert_type(all_to_all(bits), jnp.bfloat16).astype(VALUE_DTYPE)
        own = slices[rank]
        total = jnp.zeros((longest,), VALUE_DTYPE)
        for source in range(p):
            total = total + jnp.where(source == rank, own, received[source])
        return total, 2 * longest * (p - 1)

    def split(self, s: SparseStream, *, fan_in: int = 1, parts: int | None = None) -> list[SparseStream]:
        p = self.nprocs if parts is None else parts
        slot = segment_slot(s.capacity, s.size, p)
        rows = self._segments(self._checked(s), slot, p)
        out = []
        for r, capacity in enumerate(segment_capacities(s.capacity, s.size, p, fan_in, self.delta)):
            idx, val, nnz = unpack(rows[r], slot)
            seg = resize(SparseStream(idx, val, nnz, part_length(s.size, p, r)), capacity)
            out.append(merge(seg, SparseStream.empty(seg.size, 0), delta=self.delta, capacity=capacity))
        return out

    def concat(self, segments: list[SparseStream]) -> SparseStream:
        p, n = len(segments), self.size
        streams = []
        for r, seg in enumerate(segments):
            valid = jnp.arange(seg.capacity) < seg.nnz
            streams.append(SparseStream(jnp.where(valid, seg.indices + part_bounds(n, p, r)[0], n), seg.values,
                                        seg.nnz, n))
        if p == 1:
            streams.append(SparseStream.empty(n, 0))
        capacity = concatenated_capacity([seg.capacity for seg in segments], n, self.delta)
        return resize(merge_all(streams, delta=self.delta), capacity)

    def select(self, s: SparseStream, k: int, *, threshold: jax.Array | None = None,
               limit: jax.Array | None = None) -> tuple[SparseStream, SparseStream]:
        """:meth:`Transport.select`; with a run-time ``limit`` (at most ``k``) and no threshold,
        the ``limit`` entries of largest magnitude (a budget that differs between ranks)."""
        take = selected_capacity(k, s.capacity, s.size)
        valid = jnp.arange(s.capacity) < s.nnz

        def largest():  # positions, ascending: padding (zeros) only after every entry
            chosen = jnp.where(jnp.arange(take) < s.nnz, topk(s.values, take).indices, s.capacity)
            if limit is None:
                return chosen, jnp.minimum(take, s.nnz)
            count = jnp.minimum(jnp.minimum(limit, take), s.nnz).astype(INDEX_DTYPE)
            magnitudes = jnp.abs(s.values.at[chosen].get(mode="fill", fill_value=0.0))
            by_magnitude = jnp.argsort(-magnitudes, stable=True)  # ties to the lower position, as topk's
            kept = jnp.zeros((take,), bool).at[by_magnitude].set(jnp.arange(take) < count)
            return jnp.sort(jnp.where(kept, chosen, s.capacity)), count

        if threshold is None:
            chosen, count = largest()
        else:
            above = valid & (s.values != 0) & (jnp.abs(s.values) >= threshold)
            count = jnp.sum(above, dtype=INDEX_DTYPE)
            chosen, count = self._cond(count <= take, lambda: (jnp.nonzero(above, size=take, fill_value=s.capacity)[0]
                                                                 .astype(INDEX_DTYPE), count), largest)
        kept = SparseStream(s.indices.at[chosen].get(mode="fill", fill_value=s.size),
                            s.values.at[chosen].get(mode="fill", fill_value=0.0), count.astype(INDEX_DTYPE), s.size)
        left = valid.at[chosen].set(False, mode="drop")
        slots = jnp.where(left, jnp.cumsum(left) - 1, s.capacity)  # the rest packed in order; the others dropped
        pairs = SparseStream(jnp.full((s.capacity,), s.size, INDEX_DTYPE).at[slots].set(s.indices, mode="drop"),
                             jnp.zeros((s.capacity,), VALUE_DTYPE).at[slots].set(s.values, mode="drop"),
                             (s.nnz - kept.nnz).astype(INDEX_DTYPE), s.size)
        if s.capacity < s.size:  # never the dense representation
            return kept, pairs
        zeroed = SparseStream(s.indices, s.values.at[chosen].set(0.0, mode="drop"), s.nnz, s.size)
        return kept, jax.tree.map(lambda d, q: jnp.where(s.is_dense, d, q), zeroed, pairs)

    def split_regions(self, s: SparseStream, starts: jax.Array) -> list[SparseStream]:
        n, slot = s.size, min(s.capacity, s.size)
        bounds = jnp.concatenate([jnp.zeros((1,), INDEX_DTYPE), jnp.asarray(starts, INDEX_DTYPE),
                                  jnp.full((1,), n, INDEX_DTYPE)])
        bounds = jax.lax.cummax(jnp.clip(bounds, 0, n))
        s = self._checked(s)
        valid = jnp.arange(s.capacity) < s.nnz
        offsets = jnp.minimum(jnp.searchsorted(jnp.where(valid, s.indices, n), bounds, side="left"), s.nnz)
        padded = resize(s, s.capacity + slot)
        out = []
        for r in range(self.nprocs):
            count = (offsets[r + 1] - offsets[r]).astype(INDEX_DTYPE)
            inside = jnp.arange(slot) < count
            idx = jax.lax.dynamic_slice(padded.indices, (offsets[r],), (slot,))
            val = jax.lax.dynamic_slice(padded.values, (offsets[r],), (slot,))
            out.append(SparseStream(jnp.where(inside, idx, n), jnp.where(inside, val, 0.0), count, n))
        return out

    def add(self, a: SparseStream, b: SparseStream) -> SparseStream:
        return merge(a, b, delta=self.delta, capacity=a.capacity)

    def residual(self, x: SparseStream, held: SparseStream, total: SparseStream) -> SparseStream:
        return dense_stream(jnp.where(densify(total) != 0, densify(held), densify(x)))
