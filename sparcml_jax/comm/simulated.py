"""A transport that runs every rank of an algorithm at once, in one process, in numpy.

It follows the native transport's rules (a stream is dense once its count reaches SparCML's
threshold in a capacity that holds it; a range travels as its dense slice once that is no
larger than its pairs) and counts the bytes each rank sends as the ``native`` or the
``mpi4jax`` transport sends them. It checks an algorithm's definition without MPI, and it is
where the wire volumes that the real transports report come from in the tests: the same
definition, interpreted a third way. QSGD is not simulated: a quantized phase sums exactly and
counts the codes' bytes.

Example:
  >>> import numpy as np
  >>> from sparcml_jax.comm.simulated import Simulated, SimStream
  >>> from sparcml_jax.collectives.ssar_recursive_doubling import ssar_recursive_doubling
  >>> t = Simulated(nprocs=3, size=8)
  >>> ranks = [SimStream.pairs(8, 4, [r, 7], [1.0, 1.0]) for r in range(3)]
  >>> out = ssar_recursive_doubling(t, ranks)
  >>> out[0].to_dense().tolist(), t.sent
  ([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 3.0], [56.0, 16.0, 16.0])
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from sparcml_jax.comm import Combine, Quantize
from sparcml_jax.comm.topology import (allgather_capacities, block_pass, check_pairs, codes_segments,
                                       concatenated_capacity, exchange_capacity, grown_capacity, longest_part,
                                       owned_slot, part_bounds, part_capacity, passed_capacity, segment_capacities,
                                       segment_slot, selected_capacity, slices_segments)
from sparcml_jax.kernels.qsgd import qsgd_wire_bytes
from sparcml_jax.stream import dense_threshold


@dataclasses.dataclass
class SimStream:
    """One rank's stream over ``n`` entries in ``capacity`` slots: sorted pairs, or (``idx``
    None) the dense values."""

    n: int
    capacity: int
    idx: np.ndarray | None
    val: np.ndarray
    source_capacity: int = -1
    slot: int = -1  # a selected part: the pairs every rank's part has room for
    regions: bool = False  # a segment of split_regions: indices over the whole vector

    @classmethod
    def pairs(cls, n: int, capacity: int, idx, val) -> "SimStream":
        return cls(n, capacity, np.asarray(idx, np.int64), np.asarray(val, np.float32))

    @property
    def dense(self) -> bool:
        return self.idx is None

    @property
    def count(self) -> int:
        """Entries as they travel: the pairs, or n for the dense values."""
        return self.n if self.dense else len(self.idx)

    def to_dense(self) -> np.ndarray:
        if self.dense:
            return self.val.copy()
        out = np.zeros(self.n, np.float32)
        out[self.idx] = self.val
        return out

    def range(self, lo: int, hi: int) -> "SimStream":
        """Entries [lo, hi) re-based to lo: the dense slice when the source is dense."""
        if self.dense:
            return SimStream(hi - lo, hi - lo, None, self.val[lo:hi].copy())
        keep = (self.idx >= lo) & (self.idx < hi)
        return SimStream(hi - lo, hi - lo, self.idx[keep] - lo, self.val[keep])


Ranks = list  # one SimStream per rank


class Simulated:
    """Every rank's side of every operation; ``sent[r]`` counts rank r's bytes as ``wire`` sends them.

    Attributes:
      nprocs, size, delta: as for a real transport.
      wire: ``"native"`` (payloads: 8 bytes per pair or 4 per dense entry) or ``"mpi4jax"``
        (whole static buffers with their 8-byte headers).
      value_bytes: bytes of a value on the wire: 4 (float32) or 2 (bfloat16, two to a static
        buffer's int32 slot). Values are not rounded here.
    """

    name = "simulated"
    variable_length = True
    nonblocking = False

    def __init__(self, nprocs: int, size: int, delta: float = 1.0, wire: str = "native", value_bytes: int = 4):
        self.nprocs, self.size, self.delta, self.wire, self.value_bytes = nprocs, size, delta, wire, value_bytes
        self.sent = [0.0] * nprocs

    @property
    def value_bits(self) -> int:
        return 8 * self.value_bytes

    # --------------------------------------------------------------------------- rules

    def _threshold(self, n: int) -> int:
        return dense_threshold(n, self.delta)

    def _settle(self, s: SimStream) -> SimStream:
        """SparCML's switch on the actual count, where the capacity holds the dense vector."""
        if not s.dense and s.n > 0 and s.capacity >= s.n and len(s.idx) >= self._threshold(s.n):
            return SimStream(s.n, s.capacity, None, s.to_dense(), s.source_capacity)
        return s

    def _add(self, a: SimStream, b: SimStream, capacity: int, pairs_only: bool = False) -> SimStream:
        if a.dense or b.dense:
            return SimStream(a.n, capacity, None, a.to_dense() + b.to_dense())
        idx = np.union1d(a.idx, b.idx)
        total = np.zeros(a.n, np.float32)
        np.add.at(total, a.idx, a.val)
        np.add.at(total, b.idx, b.val)
        out = SimStream(a.n, capacity, idx, total[idx])
        return out if pairs_only else self._settle(out)

    def _travelling(self, s: SimStream) -> SimStream:
        """A range as it travels: its dense slice once that is no larger than its pairs."""
        if not s.dense and s.n > 0 and len(s.idx) >= self._threshold(s.n):
            return SimStream(s.n, s.capacity, None, s.to_dense())
        return s

    def _message(self, s: SimStream) -> float:
        """Bytes of one stream's message (mpi4jax: its whole static buffer)."""
        if self.wire == "native":
            return float(self.value_bytes * s.n if s.dense else (4 + self.value_bytes) * len(s.idx))
        compact = s.capacity >= s.n and self._threshold(s.n) - 1 <= s.n // 2
        if not compact:
            return self._static(s.capacity)
        half = s.n // 2
        return 4.0 * (2 + max(half + self._value_slots(half), self._value_slots(s.n)))

    def _value_slots(self, count: int) -> int:
        """int32 slots of ``count`` values in a static buffer (two bfloat16 values to a slot)."""
        return -(-count * self.value_bytes // 4)

    def _static(self, slot: int) -> float:
        """Bytes of a static buffer of ``slot`` pairs: its header, indices and values."""
        return 8.0 + 4.0 * (slot + self._value_slots(slot))

    def _concat(self, parts: Sequence[SimStream], capacity: int) -> SimStream:
        """Streams over the consecutive ranges of ``len(parts)`` (regions: over the whole vector)."""
        n, p = self.size, len(parts)
        total = sum(part.count for part in parts)
        values = np.zeros(n, np.float32)
        idx = []
        for r, part in enumerate(parts):
            lo = 0 if part.regions else part_bounds(n, p, r)[0]
            values[lo:lo + part.n] += part.to_dense()  # (regions are disjoint)
            idx.append(lo + (np.arange(part.n) if part.dense else part.idx))
        if total >= self._threshold(n) and capacity >= n:
            return SimStream(n, capacity, None, values)
        idx = np.concatenate(idx) if idx else np.zeros(0, np.int64)
        return SimStream(n, capacity, idx, values[idx])  # a dense part keeps its zeros as pairs

    # --------------------------------------------------------------------------- operations

    def exchange(self, s: Ranks, pairs: Sequence[tuple[int, int]], *, combine: Combine, keep: bool = True) -> Ranks:
        check_pairs(pairs, self.nprocs)
        capacity = exchange_capacity(s[0].capacity, s[0].n, combine, self.delta)
        out = [dataclasses.replace(x, capacity=capacity) for x in s]
        own = list(s)
        for source, _ in pairs:
            if not keep:
                own[source] = out[source] = _empty(s[source].n, capacity)
        for source, dest in pairs:
            self.sent[source] += self._message(s[source])
            got = s[source]
            out[dest] = (self._add(own[dest], got, capacity) if combine == "add"
                         else dataclasses.replace(got, capacity=capacity))
        return out

    def ring_pass(self, segments: list[Ranks], *, send: int, into: int, combine: Combine) -> list[Ranks]:
        p = self.nprocs
        out = [list(seg) for seg in segments]
        for r in range(p):
            sent = segments[(r + send) % p][r]
            self.sent[r] += self._message(sent)
            dest, j = (r + 1) % p, (r + send) % p
            kept = segments[j][dest]
            out[j][dest] = (self._add(kept, sent, kept.capacity) if combine == "add"
                            else dataclasses.replace(sent, capacity=kept.capacity))
        return out

    def reduce_scatter(self, s: Ranks, *, dense: bool = False, quantize: Quantize | None = None,
                       feedback: bool = False) -> Ranks | tuple[Ranks, Ranks]:
        parts = self._reduce_scatter(s, dense, quantize)
        if not feedback:
            return parts
        return parts, [SimStream(self.size, self.size, None, np.zeros(self.size, np.float32)) for _ in s]

    def _reduce_scatter(self, s: Ranks, dense: bool, quantize: Quantize | None) -> Ranks:
        n, p = self.size, self.nprocs
        capacity = s[0].capacity
        coded = dense and quantize is not None and (self.wire == "native" or codes_segments(capacity, n, p))
        sliced = (dense and quantize is None and self.wire != "native" and self.value_bytes == 2
                  and slices_segments(capacity, n, p))
        parts = []
        for r in range(p):
            lo, hi = part_bounds(n, p, r)
            segments = [self._travelling(s[q].range(lo, hi)) for q in range(p)]
            for q in range(p):
                if q == r:
                    continue
                if coded and (self.wire != "native" or segments[q].dense):
                    length = hi - lo if self.wire == "native" else longest_part(n, p)
                    self.sent[q] += qsgd_wire_bytes(length, bits=quantize.bits, bucket_size=quantize.bucket_size)
                elif sliced:
                    self.sent[q] += 2.0 * longest_part(n, p)
                else:
                    self.sent[q] += (self._message(segments[q]) if self.wire == "native"
                                     else self._static(segment_slot(capacity, n, p)))
            if dense:
                parts.append(SimStream(hi - lo, hi - lo, None, sum(g.to_dense() for g in segments),
                                       source_capacity=capacity))
                continue
            cap = part_capacity(capacity, n, p, r, self.delta)
            acc = SimStream(hi - lo, cap, np.zeros(0, np.int64), np.zeros(0, np.float32))
            for g in segments:
                acc = self._add(acc, g, cap)
            acc.source_capacity = capacity
            parts.append(acc)
        return parts

    def allgather(self, part: Ranks, *, dense: bool = False, quantize: Quantize | None = None,
                  width: int | None = None) -> Ranks:
        n, p = self.size, self.nprocs
        if width is not None and width < p:  # each team of width ranks gathers its own parts
            out = [None] * p
            for team in range(p // width):
                members = list(range(team * width, (team + 1) * width))
                travelling = [part[r] for r in members]
                slot, capacity = allgather_capacities(-1, travelling[0].slot, n, width, self.delta)
                for r in members:
                    message = self._message(part[r]) if self.wire == "native" else self._static(slot)
                    self.sent[r] += (width - 1) * message
                whole = self._concat(travelling, capacity)
                for r in members:
                    out[r] = dataclasses.replace(whole)
            return out
        if dense or quantize is not None:
            slot = longest_part(n, p)
            if quantize is None:
                per_rank = float(self.value_bytes * slot)
            else:
                per_rank = qsgd_wire_bytes(slot, bits=quantize.bits, bucket_size=quantize.bucket_size)
            whole = SimStream(n, n, None, np.concatenate([x.to_dense() for x in part]))
            self.sent = [sent + (p - 1) * per_rank for sent in self.sent]
            return [dataclasses.replace(whole, val=whole.val.copy()) for _ in range(p)]
        # Selected parts travel as their pairs, so that the result holds just what was selected.
        travelling = [x if x.source_capacity < 0 else self._travelling(x) for x in part]
        slot, capacity = allgather_capacities(part[0].source_capacity, part[0].slot, n, p, self.delta)
        for r in range(p):
            self.sent[r] += (p - 1) * (self._message(travelling[r]) if self.wire == "native" else self._static(slot))
        whole = self._concat(travelling, capacity)
        return [dataclasses.replace(whole) for _ in range(p)]

    def allreduce(self, s: Ranks) -> Ranks:
        n, p = self.size, self.nprocs
        if self.value_bytes != 4:
            raise ValueError("MPI cannot sum bfloat16: the dense definition runs DSAR's phases instead")
        self.sent = [sent + 2 * (p - 1) / p * 4 * n for sent in self.sent]
        total = sum(x.to_dense() for x in s)
        return [SimStream(n, n, None, total.copy()) for _ in range(p)]

    def gather(self, s: Ranks, *, width: int | None = None) -> Ranks:
        p = self.nprocs
        # Every rank, or each column: the ranks at one position of every team.
        columns = [list(range(p))] if width is None else [list(range(q, p, width)) for q in range(width)]
        g = len(columns[0])
        capacity = grown_capacity(s[0].capacity, s[0].n, g, self.delta)
        out = [None] * p
        for column in columns:
            for r in column:
                message = self._message(s[r]) if self.wire == "native" else self._static(s[r].capacity)
                self.sent[r] += (g - 1) * message
            total = dataclasses.replace(s[column[0]], capacity=capacity)
            for r in column[1:]:
                total = self._add(total, s[r], capacity)
            for r in column:
                out[r] = dataclasses.replace(total)
        return out

    def split(self, s: Ranks, *, fan_in: int = 1, parts: int | None = None) -> list[Ranks]:
        n, p = self.size, self.nprocs if parts is None else parts
        capacities = segment_capacities(s[0].capacity, n, p, fan_in, self.delta)
        segments = []
        for j in range(p):
            lo, hi = part_bounds(n, p, j)
            segments.append([dataclasses.replace(self._travelling(x.range(lo, hi)), capacity=capacities[j])
                             for x in s])
        return segments

    def concat(self, segments: list[Ranks]) -> Ranks:
        capacity = concatenated_capacity([seg[0].capacity for seg in segments], self.size, self.delta)
        return [self._concat([seg[r] for seg in segments], capacity) for r in range(self.nprocs)]

    # --------------------------------------------------------------------------- global top-k

    def select(self, s: Ranks, k: int, *, threshold: float | Sequence[float] | None = None) -> tuple[Ranks, Ranks]:
        """``threshold``: one for every rank, or each rank's own."""
        least = [threshold] * self.nprocs if threshold is None or np.ndim(threshold) == 0 else list(threshold)
        kept, rest = zip(*(_select(x, k, t) for x, t in zip(s, least)))
        return list(kept), list(rest)

    def split_regions(self, s: Ranks, starts: Sequence[int]) -> list[Ranks]:
        n = self.size
        bounds = np.maximum.accumulate(np.clip(np.concatenate([[0], np.asarray(starts, np.int64), [n]]), 0, n))
        out = []
        for r in range(self.nprocs):
            lo, hi = int(bounds[r]), int(bounds[r + 1])
            region = []
            for x in s:
                idx = np.arange(n) if x.dense else x.idx
                keep = (idx >= lo) & (idx < hi)
                region.append(SimStream(n, min(x.capacity, n), idx[keep].astype(np.int64), x.val[keep].copy(),
                                        regions=True))
            out.append(region)
        return out

    def add(self, a: Ranks, b: Ranks) -> Ranks:
        return [self._add(x, y, x.capacity) for x, y in zip(a, b)]

    def pass_blocks(self, blocks: list[Ranks], *, distance: int, count: int,
                    budgets: Sequence[int] | None = None) -> list[Ranks]:
        out = [list(block) for block in blocks]
        arriving = []
        for r in range(self.nprocs):
            dest, _, moves = block_pass(r, len(blocks), distance, count)
            for send, _ in moves:  # the dest adds it into the same block (its q + j)
                if budgets is None:  # handed over whole
                    kept, out[send][r] = blocks[send][r], dataclasses.replace(_empty(self.size, blocks[send][r].capacity),
                                                                              regions=blocks[send][r].regions)
                else:
                    kept, out[send][r] = _select(blocks[send][r], budgets[send])
                self.sent[r] += self._message(kept)
                arriving.append((send, dest, kept))
        for b, dest, kept in arriving:
            target = out[b][dest]
            capacity = passed_capacity(target.capacity, kept.capacity, target.n, budgets is None)
            out[b][dest] = dataclasses.replace(self._add(target, kept, capacity, pairs_only=target.regions),
                                               regions=target.regions)
        return out

    def select_owned(self, blocks: list[Ranks], budgets: Sequence[int], *,
                     threshold: float | None = None) -> tuple[Ranks, list[Ranks]]:
        width = len(blocks)
        slot = owned_slot(budgets, [(block[0].capacity, block[0].n) for block in blocks])
        out = [list(block) for block in blocks]
        parts = []
        for r in range(self.nprocs):
            q = r % width
            kept, out[q][r] = _select(blocks[q][r], budgets[q], threshold)
            parts.append(dataclasses.replace(kept, source_capacity=-1, slot=slot, regions=blocks[q][r].regions))
        return parts, out

    def reselect_across_teams(self, part: Ranks, budgets: Sequence[int]) -> Ranks:
        width = len(budgets)
        summed = self.gather(part, width=width)
        return [dataclasses.replace(_select(x, budgets[r % width])[0], source_capacity=-1, slot=part[r].slot)
                for r, x in enumerate(summed)]

    def residual(self, x: Ranks, held: Ranks, total: Ranks) -> Ranks:
        out = []
        for own, h, t in zip(x, held, total):
            values = own.to_dense()
            chosen = t.to_dense() != 0
            values[chosen] = h.to_dense()[chosen]
            out.append(SimStream(own.n, own.n, None, values))
        return out


def _empty(n: int, capacity: int) -> SimStream:
    return SimStream(n, capacity, np.zeros(0, np.int64), np.zeros(0, np.float32))


def magnitude_key(values: np.ndarray) -> np.ndarray:
    """:func:`sparcml_jax.topk`'s order: the IEEE-754 bits of |v| as an unsigned integer."""
    return np.asarray(values, np.float32).view(np.uint32) & np.uint32(0x7FFFFFFF)


def _select(s: SimStream, k: int, threshold: float | None = None) -> tuple[SimStream, SimStream]:
    """(Top min(k, entries) by magnitude, ties to the lower index, as pairs; the rest of s). With
    a threshold: the nonzero entries of at least its magnitude, if no more than k; else the top k."""
    idx = np.arange(s.n) if s.dense else s.idx
    take = min(k, len(idx))
    above = np.flatnonzero((s.val != 0) & (np.abs(s.val) >= np.float32(threshold))) if threshold is not None else None
    if above is not None and len(above) <= take:
        chosen = above
    else:
        chosen = np.sort(np.lexsort((idx, -magnitude_key(s.val).astype(np.int64)))[:take])
    kept = SimStream(s.n, selected_capacity(k, s.capacity, s.n), idx[chosen].astype(np.int64), s.val[chosen].copy())
    if s.dense:
        values = s.val.copy()
        values[chosen] = 0.0
        return kept, SimStream(s.n, s.capacity, None, values)
    rest = np.ones(len(idx), bool)
    rest[chosen] = False
    return kept, SimStream(s.n, s.capacity, s.idx[rest], s.val[rest])
