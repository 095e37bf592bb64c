"""The cost model behind ``algorithm="auto"`` (SparCML §5.3 and Appendix B), which also prices
the global top-k allreduces (SparDL, gTop-k, Ok-Topk).

The model prices an algorithm by running its definition on :class:`Pricing`, a transport whose
streams are estimates: every operation adds its predicted seconds, so the model prices exactly
the messages and merges the algorithm makes. A message of ``b`` bytes costs ``alpha + b beta``.
Result density follows the uniform union bound: ``m`` streams of ``k`` random nonzeros out of
``N`` cover ``N (1 - (1 - k/N)^m)`` indices. A selection (the global top-k algorithms re-select
inside the collective) holds the entries it kept, whatever the fan-in: SparDL's result stays at
about ``k`` entries for any P. On top of the paper's wire terms the model prices what dominates
on a node: the dense allreduce as measured, merges per pair, passes over length-N buffers and
the selections' reads of their values.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import TYPE_CHECKING, Hashable, Sequence

from mpi4py import MPI

from sparcml_jax.comm import STATIC_BUFFER_TRANSPORTS, Combine, Quantize
from sparcml_jax.comm.topology import (allgather_capacities, block_pass, codes_segments, exchange_capacity,
                                       gathered_capacity, grown_capacity, largest_part_capacity, longest_part,
                                       owned_slot, part_capacity, passed_capacity, peers_of, segment_capacities,
                                       segment_slot, selected_capacity, slices_segments)
from sparcml_jax.kernels.qsgd import qsgd_wire_bytes
from sparcml_jax.stream import dense_threshold

if TYPE_CHECKING:
    from jax.sharding import Mesh


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Time of one allreduce, from quantities measured on the communicator (see
    :mod:`sparcml_jax.collectives.calibrate`), or given.

    Attributes:
      alpha: seconds per message (latency), from a ping-pong between ranks 0 and 1.
      beta: seconds per byte on the wire, from messages of 16 MB exchanged by all ranks in pairs
        at once, as in a round of recursive doubling (on a node the ranks' copies then share
        cores and the memory bus; on a network every link is busy): the median of 15.
      dense_alpha, dense_beta: the dense MPI_Allreduce measured as a whole (a small one, and
        seconds per byte of the vector from the median of 15 of 16 MB, past the caches, in a
        jitted program as a training step runs it): on a node it is bound by memory and by the
        ranks sharing cores, not by the wire, and the SparCML algorithms must beat the real thing.
      pair_cost: seconds per (index, value) pair merged on a rank, from the merge kernel timed
        on streams of 4 MB, two merges and a merge of their results as a collective chains them.
      element_cost: seconds per float32 element read or written by a pass over a length-N
        vector (densify, padding, a result buffer): half a jitted ``x * 2`` over 16 MB into a
        fresh buffer.
      select_cost: seconds per value a top-k selection reads (:func:`sparcml_jax.topk`, the
        radix selection of the global top-k algorithms): the kernel on 2^22 dense values at 1 %,
        every rank at once (:func:`sparcml_jax.collectives.selection_cost.measure_select_cost`).
        It is compute-bound (histograms), so not a multiple of ``element_cost``: 0.5 ns per value
        in one process here at 2^22 and at 2^24, where a pass's cost per element differed 7x.

    Example:
      >>> from sparcml_jax import CostModel
      >>> model = CostModel(alpha=2e-6, beta=1e-10, dense_alpha=5e-6, dense_beta=3e-10, pair_cost=1e-9,
      ...                   element_cost=3e-10)
      >>> top_k = dict(size=1 << 22, nnz=4096, capacity=4096, nprocs=8)  # 0.1 % of 4M values per rank
      >>> sparse = model.predict("ssar_recursive_doubling", **top_k)
      >>> dense = model.predict("dense", **top_k)
      >>> bool(sparse < dense)
      True

      A global top-k takes the dense accumulator; ``nnz`` is ``k``, the size of its result.
      SparDL's Spar-Reduce-Scatter sends P - 1 blocks of k / P pairs whatever P is:

      >>> srs = [model.pricing("spardl", size=1 << 22, nnz=41943, nprocs=p).sent for p in (8, 64)]
      >>> [round(b / 8) for b in srs]  # pairs sent per rank: (P - 1) kb + (P - 1) kb (allgather)
      [73402, 82656]
    """

    alpha: float
    beta: float
    dense_alpha: float = 0.0
    dense_beta: float = 0.0
    pair_cost: float = 0.0
    element_cost: float = 0.0
    select_cost: float = 0.0

    @classmethod
    def calibrate(cls, comm: MPI.Comm) -> "CostModel":
        """Measures the model on ``comm``: a collective call (see :func:`calibrate.measure` and
        :func:`selection_cost.measure_select_cost`)."""
        from sparcml_jax.collectives.calibrate import measure
        from sparcml_jax.collectives.selection_cost import measure_select_cost

        return cls(*measure(comm), select_cost=measure_select_cost(comm))

    @classmethod
    def calibrate_on_axis(cls, mesh: "Mesh", axis_name: Hashable) -> "CostModel":
        """Measures the model over the devices of ``axis_name`` of ``mesh`` (a
        :class:`jax.sharding.Mesh`), for ``algorithm="auto"`` with ``axis_name=``: messages are
        ``ppermute``, the dense allreduce is ``psum``. Call it outside ``jax.shard_map``, on
        every process of the mesh (see :mod:`sparcml_jax.collectives.calibrate_on_axis`).

        Example (on forced CPU devices, ``--xla_force_host_platform_device_count=4``):
          >>> import jax, sparcml_jax
          >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
          >>> model = sparcml_jax.CostModel.calibrate_on_axis(mesh, "data")  # doctest: +SKIP
        """
        from sparcml_jax.collectives.calibrate_on_axis import measure_on_axis

        return cls(*measure_on_axis(mesh, axis_name))

    def save(self, path: str) -> None:
        """Writes the model as JSON (``SPARCML_JAX_COST_MODEL`` names such a file)."""
        with open(path, "w") as f:
            json.dump(dataclasses.asdict(self), f, indent=1)
            f.write("\n")

    @classmethod
    def load(cls, path: str) -> "CostModel":
        """The model saved in ``path`` by :meth:`save`."""
        try:
            with open(path) as f:
                fields = json.load(f)
            return cls(**fields)
        except (OSError, ValueError, TypeError) as e:
            raise ValueError(f"cannot read a cost model from {path!r} ({e}); write one with "
                             "`python -m sparcml_jax.bench calibrate --out FILE`") from e

    def latency(self, nprocs: int) -> float:
        """Seconds per round in which every rank communicates at once.

        The ping-pong's alpha, but no less than a round of the small dense allreduce (which
        takes log2 P of them): when ranks share cores, a message waits for its receiver to be
        scheduled, which a ping-pong between two ranks does not see.
        """
        return max(self.alpha, self.dense_alpha / max(1.0, math.log2(nprocs)))

    def message(self, nbytes: float, nprocs: int) -> float:
        return self.latency(nprocs) + nbytes * self.beta

    def predict(self, algorithm: str, *, size: int, nnz: float, nprocs: int, transport: str = "native",
                capacity: int | None = None, quantize_bits: int | None = None, delta: float = 1.0,
                value_bits: int = 32) -> float:
        """Predicted seconds of one allreduce of streams of ``nnz`` nonzeros (the largest over
        ranks) and static ``capacity`` (default: ``size``). For a global top-k algorithm
        (``GLOBAL_TOPK_ALGORITHMS``) the input is every rank's dense accumulator and ``nnz`` is
        ``k``, the size of the result; its local selections are priced too."""
        return self.pricing(algorithm, size=size, nnz=nnz, nprocs=nprocs, transport=transport, capacity=capacity,
                            quantize_bits=quantize_bits, delta=delta, value_bits=value_bits).seconds

    def pricing(self, algorithm: str, *, size: int, nnz: float, nprocs: int, transport: str = "native",
                capacity: int | None = None, quantize_bits: int | None = None, delta: float = 1.0,
                value_bits: int = 32) -> "Pricing":
        """The algorithm's definition run on :class:`Pricing`: its seconds, bytes sent and staged elements."""
        from sparcml_jax.collectives._plan import ENGINE_ALGORITHMS, GLOBAL_TOPK_ALGORITHMS, Quantization, definition

        if algorithm in GLOBAL_TOPK_ALGORITHMS:
            return self._global_topk_pricing(algorithm, size=size, k=int(nnz), nprocs=nprocs, transport=transport,
                                             delta=delta)
        capacity = size if capacity is None else capacity
        if transport == "mpi4jax" and algorithm in ENGINE_ALGORITHMS:
            transport = "native"  # (the MPI transports run them alike)
        # Whole static buffers: the mpi4jax and xla transports are priced as full as their capacities
        # allow.
        per_rank = capacity if transport in STATIC_BUFFER_TRANSPORTS else nnz
        t = Pricing(self, size=size, nnz=per_rank, nprocs=nprocs, transport=transport, delta=delta,
                    value_bytes=value_bits // 8)
        if nprocs > 1:
            # QSGD codes DSAR's dense phases; the other algorithms send exact pairs.
            coded = quantize_bits and algorithm == "dsar_split_allgather"
            options = {"quantize": Quantization(quantize_bits)} if coded else {}
            t.result(definition(algorithm)(t, Estimate(size, capacity, 1), **options))
        return t

    def _global_topk_pricing(self, algorithm: str, *, size: int, k: int, nprocs: int, transport: str,
                             delta: float) -> "Pricing":
        """A global top-k on the dense accumulators: priced for any P (one rank still selects).
        Ok-Topk is priced on a step between its re-evaluations (most of its steps): thresholds
        carried from an earlier step, each selecting about k entries, and regions balanced."""
        from sparcml_jax.collectives._plan import definition

        k = min(k, size)
        t = Pricing(self, size=size, nnz=size, nprocs=nprocs, transport=transport, delta=delta, target=k)
        options = {}
        if algorithm == "oktopk":
            options = dict(local_threshold=CARRIED, global_threshold=CARRIED, starts=CARRIED, exact=False)
            t.charge_passes(size)  # the step counts what its carried threshold selects in x (XLA)
        # The accumulator enters as a dense stream: XLA writes its indices 0..N-1.
        t.charge_passes(size)
        total, residual = definition(algorithm)(t, Estimate(size, size, 1, entries=size), k=k, **options)
        t.result(total)
        t.hand_over_residual(residual)
        return t


@dataclasses.dataclass(frozen=True)
class Estimate:
    """A stream as the model sees it: over ``size`` entries, in ``capacity`` static slots, the
    sum of ``fan_in`` ranks' streams (each of the per-rank count, uniform over the vector).
    ``dense_values`` marks a reduce-scatter's dense slice; a part keeps ``source_capacity`` (-1:
    a selected part, which travels as its pairs). ``entries``, when not negative, is the
    expected count itself (a selection's, a dense vector's) in place of the union bound.
    ``pairs_only`` marks an Ok-Topk region: pairs whatever their count, over a span of ``size``
    entries (its indices lie in the whole vector)."""

    size: int
    capacity: int
    fan_in: int
    dense_values: bool = False
    source_capacity: int = -1
    entries: float = -1.0
    pairs_only: bool = False


class Pricing:
    """The cost model's :class:`~sparcml_jax.comm.Transport`: adds up the predicted seconds of
    rank 0, which takes part in every round of every schedule here, with ranges priced at the
    longest. By the symmetry of the schedules, what a rank receives is priced like what it sends.

    ``staged`` counts the elements XLA reads and writes around the mpi4jax transport's MPI calls
    on its busiest rank (packing, padding and slicing whole static buffers; XLA's own ``bytes
    accessed / 4``, which tests/mpi/test_cost_model.py checks); the native transport stages nothing.
    """

    name = "pricing"
    nonblocking = False

    def __init__(self, model: CostModel, *, size: int, nnz: float, nprocs: int, transport: str, delta: float,
                 target: int | None = None, value_bytes: int = 4):
        self.model, self.n, self.nprocs, self.delta = model, size, nprocs, delta
        self.value_bytes = float(value_bytes)  # of a value on the native wire (2: bfloat16)
        # A global top-k's k: the entries a carried threshold selects in all.
        self.target = target
        self.static = transport in STATIC_BUFFER_TRANSPORTS
        self.variable_length = not self.static
        self.k = float(nnz)
        self._seconds = 0.0
        self._sent = 0.0
        self.messages = 0  # rank 0's messages priced so far (rounds of every rank at once)
        self.result_entries = 0.0  # the expected entries of the result, once priced
        self._staged = [0.0] * nprocs
        # A rank that takes no part in an exchange pads its stream to the new capacity; XLA drops
        # the padding if the stream is replaced before it is used.
        self._padding = [0.0] * nprocs

    @property
    def value_bits(self) -> int:
        return 8 * int(self.value_bytes)

    @property
    def seconds(self) -> float:
        """The predicted time: the operations', and a pass's cost per staged element."""
        return self._seconds + self.staged * self.model.element_cost

    @property
    def staged(self) -> float:
        return max(s + pad for s, pad in zip(self._staged, self._padding)) if self.static else 0.0

    @property
    def size(self) -> int:
        return self.n

    @property
    def sent(self) -> float:
        """Bytes rank 0 sends in the operations priced so far by their messages (the exchanges,
        Spar-Reduce-Scatter rounds and allgathers of selected parts)."""
        return self._sent

    def charge_passes(self, elements: float) -> None:
        """Elements read or written by local passes outside the definition's operations."""
        self._seconds += elements * self.model.element_cost

    def hand_over_residual(self, residual: Estimate) -> None:
        """A global top-k's residual is written into the caller's length-N buffer (natively; the
        mpi4jax transport's is an XLA value already)."""
        if not self.static:
            self.charge_passes(2 * residual.size)

    def _stage_everywhere(self, elements: float) -> None:
        self._staged = [s + elements for s in self._staged]

    # --------------------------------------------------------------------------- estimates

    def count(self, e: Estimate) -> float:
        """Expected entries of ``e``: the union bound, or for static buffers the sum of capacities."""
        if e.entries >= 0:
            return min(e.entries, e.size)
        n = max(self.n, 1)
        if self.static:
            return min(self.k * e.fan_in * e.size / n, e.size)
        return e.size * (1.0 - (1.0 - min(self.k, n) / n) ** e.fan_in)

    def is_dense(self, e: Estimate) -> bool:
        if e.pairs_only:
            return False
        return e.dense_values or (e.capacity >= e.size and 8.0 * self.count(e) >= 4.0 * e.size)

    @property
    def slot_bytes(self) -> float:
        """Bytes of one pair in a static buffer: its int32 index and its value."""
        return 4.0 + self.value_bytes

    def wire(self, e: Estimate) -> float:
        """Bytes of a message carrying ``e``: the valid pairs or the dense values (native), or
        the whole static buffer (mpi4jax: an 8-byte header and 8 bytes per slot, 6 on a bfloat16
        wire; once the capacity holds the dense vector, room for n / 2 pairs)."""
        if self.static:
            return 8.0 + (self.slot_bytes * e.size / 2 if e.capacity >= e.size else self.slot_bytes * e.capacity)
        vb = self.value_bytes
        return vb * e.size if e.dense_values else min((4.0 + vb) * self.count(e), vb * e.size)

    def _result_buffers(self, e: Estimate) -> float:
        """A result of capacity N: fresh length-N index and value buffers (values only for a
        result dense by construction)."""
        if e.capacity < e.size:
            return 0.0
        return (1 if e.dense_values else 2) * e.size * self.model.element_cost

    def _merge(self, a: Estimate, b: Estimate, out: Estimate) -> float:
        """Merging two streams. Streams held in fewer slots than their size are pairs however full
        (the kernel visits the valid ones; a result that turns dense is then densified); only
        streams of full capacity can be dense vectors, added in one pass."""
        m = self.model
        if self.is_dense(a) or self.is_dense(b):
            return 3 * out.size * m.element_cost + self._result_buffers(out)
        cost = (self.count(a) + self.count(b)) * m.pair_cost
        if self.is_dense(out):
            cost += 2 * out.size * m.element_cost
        return cost + self._result_buffers(out)

    def _assembly(self, entries: float) -> float:
        """Joining parts over disjoint ranges into one stream: the native engine copies each part
        into place (its indices re-based), XLA merges them."""
        return entries * (self.model.pair_cost if self.static else 2 * self.model.element_cost)

    @staticmethod
    def _exchange_staging(e: Estimate, send: bool, receive: bool) -> float:
        """The compact message of n slots (pairs or dense values, chosen at run time); smaller
        streams travel straight from and into XLA's buffers."""
        return (9 * e.size * send + 4 * e.size * receive) if e.capacity >= e.size else 0.0

    def _scatter_staging(self, e: Estimate) -> float:
        """P segments cut, packed, sent and unpacked (whole static rows)."""
        slot = segment_slot(e.capacity, e.size, self.nprocs)
        return 5 * e.capacity + 2 * slot + 10 * self.nprocs * slot

    def result(self, e: Estimate) -> None:
        """The result is handed over in its static capacity: the slots past its entries are
        written too (padding), and whatever consumes the stream visits them."""
        self.result_entries = self.count(e)
        self._seconds += 2 * max(e.capacity - self.count(e), 0.0) * self.model.element_cost

    # --------------------------------------------------------------------------- operations

    def _send(self, nbytes: float, sends: bool = True) -> float:
        """One message of rank 0's round (priced whether rank 0 sends it or receives its like)."""
        self.messages += 1
        if sends:
            self._sent += nbytes
        return self.model.message(nbytes, self.nprocs)

    def exchange(self, s: Estimate, pairs: Sequence[tuple[int, int]], *, combine: Combine,
                 keep: bool = True) -> Estimate:
        out = Estimate(s.size, exchange_capacity(s.capacity, s.size, combine, self.delta), s.fan_in,
                       entries=s.entries)
        for r in range(self.nprocs):
            to, frm = peers_of(pairs, r)
            if to >= 0 or (frm >= 0 and combine == "add"):  # the stream is used: its padding stays
                self._staged[r] += self._padding[r]
                self._padding[r] = 0.0
            elif frm >= 0:
                self._padding[r] = 0.0
            self._staged[r] += self._exchange_staging(s, to >= 0, frm >= 0)
            if frm < 0 and out.capacity > s.capacity:
                self._padding[r] += 2 * s.capacity + 2 * out.capacity
        dest, source = peers_of(pairs, 0)
        if dest < 0 and source < 0:
            return out
        self._seconds += self._send(self.wire(s), dest >= 0)
        handed_over = not keep and dest >= 0  # rank 0 is left with what it receives, or nothing
        if handed_over:
            return dataclasses.replace(out, entries=self.count(s) if source >= 0 else 0.0)
        if source >= 0 and combine == "add":
            entries = _union(self.count(s), self.count(s), s.size) if s.entries >= 0 else -1.0
            out = dataclasses.replace(out, fan_in=min(2 * s.fan_in, self.nprocs), entries=entries)
            self._seconds += self._merge(s, s, out)
        return out

    def ring_pass(self, segments: list[Estimate], *, send: int, into: int, combine: Combine) -> list[Estimate]:
        p = self.nprocs
        sent, target = segments[send % p], segments[into % p]
        self._seconds += self._send(self.wire(sent))
        self._stage_everywhere(self._exchange_staging(sent, True, True))
        if combine == "add":
            out = dataclasses.replace(target, fan_in=min(target.fan_in + sent.fan_in, p))
            self._seconds += self._merge(target, dataclasses.replace(sent, capacity=target.capacity), out)
        else:
            out = dataclasses.replace(target, fan_in=sent.fan_in)
        return [out if j == into % p else seg for j, seg in enumerate(segments)]

    def reduce_scatter(self, s: Estimate, *, dense: bool = False, quantize: Quantize | None = None,
                       feedback: bool = False) -> Estimate | tuple[Estimate, Estimate]:
        m, p, n = self.model, self.nprocs, s.size
        length = longest_part(n, p)
        # Every segment travels at its whole slot (static buffers), or range r of the stream goes to
        # rank r; a quantized one that travels dense goes as its QSGD codes.
        segment = 8.0 + self.slot_bytes * segment_slot(s.capacity, n, p) if self.static else self.wire(s) / p
        if self.static and dense and quantize is None and self.value_bytes == 2 and slices_segments(s.capacity, n, p):
            segment = 2.0 * length  # a bfloat16 range's dense values
        coded = dense and quantize is not None and (codes_segments(s.capacity, n, p) if self.static
                                                    else self.is_dense(s))
        if coded:
            segment = float(qsgd_wire_bytes(length, bits=quantize.bits, bucket_size=quantize.bucket_size))
            self._seconds += 4 * (p - 1) / p * n * m.element_cost  # coded by the senders, decoded by the owners
        sends = (p - 1) * self._send(segment)
        self.messages += p - 2
        self._sent += (p - 2) * segment
        self._stage_everywhere(self._scatter_staging(s))
        if dense and not self.static and self.is_dense(s):
            # The slices are sent from where they lie and added into a zero-filled slice (each
            # element read twice and written once).
            self._seconds += sends + (1 / p + 3) * n * m.element_cost
        elif dense and not self.static:
            # The segments are added into a zero-filled slice, no merge: every pair of the stream
            # is read and re-based into its range's message (4 element accesses), then read and
            # added into its owner's slice (3).
            self._seconds += sends + (1 / p + 1) * n * m.element_cost + 7 * self.count(s) * m.element_cost
        else:
            # What arrives is merged segment after segment into the growing part: the part's
            # pairs are visited (P + 1) / 2 times on average.
            self._seconds += sends + (p + 1) / 2 * self.count(s) * m.pair_cost
        capacity = length if dense else max(part_capacity(s.capacity, n, p, r, self.delta) for r in range(p))
        part = Estimate(length, capacity, p, dense_values=dense, source_capacity=s.capacity)
        if not feedback:
            return part
        # The error: a zeroed length-N vector, and this rank's codes decoded and subtracted.
        self._seconds += (1 + 3 * (p - 1) / p) * n * m.element_cost
        return part, Estimate(n, n, 1, dense_values=True)

    def allgather(self, part: Estimate, *, dense: bool = False, quantize: Quantize | None = None,
                  width: int | None = None) -> Estimate:
        m, p, n = self.model, self.nprocs, self.n
        if part.source_capacity < 0 and not (dense or quantize is not None):
            return self._allgather_selected(part, p if width is None else width)
        rounds = math.log2(p) * m.latency(p)
        self.messages += math.ceil(math.log2(p))
        if dense or quantize is not None:
            # Every rank receives the other P - 1 slices (or their codes): bytes on the wire, like
            # every other message (in place, no reduction: not half of an allreduce, whose price
            # holds its sums and its fresh result on a node).
            value_bytes = self.value_bytes if quantize is None else quantize.bits / 8.0
            out = Estimate(n, n, p, dense_values=True)
            self._seconds += rounds + (p - 1) * longest_part(n, p) * value_bytes * m.beta
            self._sent += (p - 1) * longest_part(n, p) * value_bytes
            if quantize is not None:  # QSGD codes and decodes every element
                self._seconds += 4 * n * m.element_cost + self._result_buffers(out)
            if self.static:  # the part densified, the gathered slices padded, concatenated and cut back
                self._stage_everywhere(2 * n + longest_part(n, p) * (1 + 2 * (n % p != 0)))
                self._seconds += 0.0 if quantize is not None else self._result_buffers(out)
            return out
        whole = Estimate(n, gathered_capacity(part.source_capacity, n, p, self.delta), p,
                         source_capacity=part.source_capacity)
        if self.static:  # every part at the largest part's slot; P parts packed, gathered, re-based
            slot = largest_part_capacity(part.source_capacity, n, p, self.delta)
            self._seconds += rounds + (p - 1) * self.slot_bytes * slot * m.beta
            self._sent += (p - 1) * (8.0 + self.slot_bytes * slot)
            # The parts packed, gathered and re-based; the merged result cut to its capacity when
            # the union bound is below the parts' slots.
            merged = min(p * slot, n) if p * slot < dense_threshold(n, self.delta) else n
            self._stage_everywhere(4 * slot + 6 * p * slot + (2 * whole.capacity if whole.capacity < merged else 0))
        else:
            self._seconds += rounds + (p - 1) * self.wire(whole) / p * m.beta
            self._sent += (p - 1) * self.wire(whole) / p
        self._seconds += self._assembly(self.count(whole)) + self._result_buffers(whole)
        return whole

    def _allgather_selected(self, part: Estimate, p: int) -> Estimate:
        """Every rank's selected part (of its team of ``p``), as its pairs (never a dense slice):
        the result holds the p selections, about k entries, whatever p is."""
        m, n = self.model, self.n
        slot, capacity = allgather_capacities(-1, part.capacity, n, p, self.delta)
        whole = Estimate(n, capacity, p, entries=p * self.count(part))
        nbytes = 8.0 + 8.0 * slot if self.static else 8.0 * self.count(part)
        self._seconds += math.log2(p) * m.latency(self.nprocs) + (p - 1) * nbytes * m.beta
        self._sent += (p - 1) * nbytes
        self.messages += math.ceil(math.log2(p))
        if self.static:  # packed, gathered, re-based and merged in XLA
            self._stage_everywhere(4 * slot + 6 * p * slot)
        self._seconds += self._assembly(self.count(whole)) + self._result_buffers(whole)
        return whole

    def allreduce(self, s: Estimate) -> Estimate:
        if self.value_bytes != 4.0:
            raise ValueError("MPI cannot sum bfloat16: the dense definition runs DSAR's phases instead")
        m = self.model
        out = Estimate(s.size, s.size, self.nprocs, dense_values=True)
        # A dense input is reduced from where it lies. Pairs are densified into the result (the
        # zero-filled vector, and each pair's index and value read and its entry written), which
        # is then reduced in place. The XLA transport densifies into a fresh XLA buffer first.
        self._seconds += m.dense_alpha + 4.0 * s.size * m.dense_beta + self._result_buffers(out)
        if not self.is_dense(s):
            self._seconds += 3 * self.count(s) * m.element_cost
        self._sent += 2 * (self.nprocs - 1) / self.nprocs * 4.0 * s.size
        if self.static:
            self._seconds += 2 * s.size * m.element_cost
        return out

    def gather(self, s: Estimate, *, width: int | None = None) -> Estimate:
        """Every rank's stream (with ``width``: of the ranks at its position in every team of
        ``width``), summed."""
        m = self.model
        p = self.nprocs if width is None else self.nprocs // width
        out = Estimate(s.size, grown_capacity(s.capacity, s.size, p, self.delta), p)
        if s.entries >= 0:
            out = dataclasses.replace(out, entries=min(s.size * (1 - (1 - self.count(s) / max(s.size, 1)) ** p),
                                                       out.capacity))
        self._seconds += math.log2(p) * m.latency(self.nprocs) + (p - 1) * self.wire(s) * m.beta
        self._sent += (p - 1) * self.wire(s)
        self.messages += math.ceil(math.log2(p))
        self._seconds += p * self.count(s) * m.pair_cost + self._result_buffers(out)
        return out

    def split(self, s: Estimate, *, fan_in: int = 1, parts: int | None = None) -> list[Estimate]:
        p = self.nprocs if parts is None else parts
        length = longest_part(s.size, p)
        self._stage_everywhere(self._scatter_staging(s))
        if not (self._known_dense(s) and not self.static):  # a dense vector's segments are views of it
            self._seconds += self.count(s) * self.model.element_cost  # the indices re-based
        capacities = segment_capacities(s.capacity, s.size, p, fan_in, self.delta)
        entries = -1.0 if s.entries < 0 else self.count(s) * length / max(s.size, 1)
        return [Estimate(length, max(capacities), s.fan_in, entries=entries) for _ in range(p)]

    def concat(self, segments: list[Estimate]) -> Estimate:
        n = self.n
        known = all(seg.entries >= 0 for seg in segments)
        out = Estimate(n, grown_capacity(sum(seg.capacity for seg in segments), n, 1, self.delta),
                       max(seg.fan_in for seg in segments),
                       entries=sum(self.count(seg) for seg in segments) if known else -1.0)
        self._seconds += self._assembly(sum(self.count(seg) for seg in segments)) + self._result_buffers(out)
        return out

    # --------------------------------------------------------------------------- global top-k

    def _fresh_dense(self, size: int) -> float:
        """A fresh dense buffer of the native engine is zero-filled as it is allocated (a
        std::vector): one more write per element before the copy into it."""
        return 0.0 if self.static else size * self.model.element_cost

    def _known_dense(self, e: Estimate) -> bool:
        """A stream known to be a dense vector (a global top-k's accumulator and its blocks)."""
        return e.entries >= 0 and self.is_dense(e)

    def select(self, s: Estimate, k: int, *, threshold=None) -> tuple[Estimate, Estimate]:
        """The radix selection reads every entry; the kept pairs are written, and the rest is
        copied (a dense vector with the kept entries zeroed, or the other pairs). On mpi4jax the
        rest is packed by scatters over the whole capacity.

        A carried ``threshold`` (Ok-Topk's) is estimated to pass this stream's share of the
        global top-k (k of the whole vector, uniform supports) and selects in two scans (count,
        then collect) instead of a radix selection."""
        m = self.model
        entries = self.count(s)
        if threshold is None:
            take, reads = min(float(k), entries), entries * m.select_cost
        else:
            share = self.target * s.size / max(self.n, 1) if self.target is not None else k
            take, reads = min(float(k), entries, share), 2 * entries * m.element_cost
        kept = Estimate(s.size, selected_capacity(k, s.capacity, s.size), s.fan_in, entries=take,
                        pairs_only=s.pairs_only)
        dense = self.is_dense(s)
        rest = dataclasses.replace(s, entries=s.size if dense else entries - take)
        rest_copy = 2 * s.size if dense else 4 * (entries - take)
        self._seconds += reads + (2 * take + rest_copy) * m.element_cost + (self._fresh_dense(s.size) if dense else 0.0)
        if self.static:
            self._stage_everywhere(6 * s.capacity)
        return kept, rest

    def add(self, a: Estimate, b: Estimate) -> Estimate:
        """``a + b`` on this rank. Into a dense vector: a copy of it, and the other's pairs added
        at random places (priced like merged pairs); two pair streams: a merge."""
        m, n = self.model, a.size
        if self.is_dense(a) or self.is_dense(b):
            other = b if self.is_dense(a) else a
            if self.is_dense(other):
                self._seconds += 3 * n * m.element_cost
            else:
                self._seconds += 2 * n * m.element_cost + self.count(other) * m.pair_cost
            self._seconds += self._fresh_dense(n)
            return dataclasses.replace(a, fan_in=min(a.fan_in + b.fan_in, self.nprocs), entries=float(n))
        entries = min(_union(self.count(a), self.count(b), n), a.capacity)
        out = dataclasses.replace(a, fan_in=min(a.fan_in + b.fan_in, self.nprocs), entries=entries)
        self._seconds += (self.count(a) + self.count(b)) * m.pair_cost
        if self.is_dense(out):
            self._seconds += 2 * n * m.element_cost
        return out

    def pass_blocks(self, blocks: list[Estimate], *, distance: int, count: int,
                    budgets: Sequence[int] | None = None) -> list[Estimate]:
        """A Spar-Reduce-Scatter round on rank 0: ``count`` blocks selected and sent, one message
        each, and as many received and added into its own blocks (priced like those sent).
        Without ``budgets`` (Ok-Topk) a region is handed over whole and merged as pairs into the
        owner's, which grows by the union bound over its span."""
        out = list(blocks)
        _, _, moves = block_pass(0, len(blocks), distance, count)
        for send, into in moves:
            if budgets is None:
                kept, out[send] = out[send], dataclasses.replace(out[send], entries=0.0)
            else:
                kept, out[send] = self.select(out[send], budgets[send])
            self._seconds += self._send(self.wire(kept))
            if budgets is None:
                target = out[into]
                capacity = passed_capacity(target.capacity, kept.capacity, self.n, True)
                entries = min(_union(self.count(target), self.count(kept), target.size), capacity)
                self._seconds += (self.count(target) + self.count(kept)) * self.model.pair_cost
                out[into] = dataclasses.replace(target, capacity=capacity, fan_in=min(target.fan_in + 1, self.nprocs),
                                                entries=entries)
            else:
                out[into] = self.add(out[into], kept)
        return out

    def select_owned(self, blocks: list[Estimate], budgets: Sequence[int], *,
                     threshold=None) -> tuple[Estimate, list[Estimate]]:
        out = list(blocks)
        slot = owned_slot(budgets, [(b.capacity, b.size) for b in blocks])
        kept, out[0] = self.select(blocks[0], budgets[0], threshold=threshold)
        return dataclasses.replace(kept, capacity=slot, source_capacity=-1), out

    def split_regions(self, s: Estimate, starts) -> list[Estimate]:
        """Ok-Topk's P regions, balanced by the selected indices: each holds a P-th of the
        selection over a P-th of the vector (uniform supports); a stream's regions are views."""
        p = self.nprocs
        span = longest_part(self.n, p)
        if self.is_dense(s):  # a dense stream's regions are copied out as pairs
            self.charge_passes(3 * self.n)
        return [Estimate(span, min(s.capacity, self.n), s.fan_in, entries=self.count(s) / p, pairs_only=True)
                for _ in range(p)]

    def reselect_across_teams(self, part: Estimate, budgets: Sequence[int]) -> Estimate:
        """SparDL's Spar-All-Gather across teams: the owners of a block in every team sum their
        selections (a gather among the P / ``len(budgets)`` of them) and re-select to the budget."""
        summed = self.gather(dataclasses.replace(part, capacity=part.capacity), width=len(budgets))
        kept, _ = self.select(summed, budgets[0])
        return dataclasses.replace(kept, capacity=part.capacity, source_capacity=-1)

    def residual(self, x: Estimate, held: Estimate, total: Estimate) -> Estimate:
        """The input copied into a fresh vector, the held values densified unless dense, and
        the result's entries looked up (two random reads each). mpi4jax densifies all three."""
        m, n = self.model, x.size
        passes = 2 * n + (0 if self.is_dense(held) else 2 * n)
        self._seconds += passes * m.element_cost + self.count(total) * m.pair_cost + self._fresh_dense(n)
        if self.static:
            self._stage_everywhere(6 * n)
        return Estimate(n, n, self.nprocs, entries=float(n))


class _Carried:
    """A run-time value of an earlier step (Ok-Topk's thresholds and region starts), as the
    model sees it: the value Ok-Topk's estimates aim at."""

    def __repr__(self) -> str:
        return "CARRIED"


CARRIED = _Carried()


def _union(a: float, b: float, size: int) -> float:
    """Expected entries of the sum of streams of ``a`` and ``b`` entries on independent uniform supports."""
    return a + b - a * b / max(size, 1)


def staged_elements(algorithm: str, *, size: int, nprocs: int, capacity: int, delta: float = 1.0) -> float:
    """Elements that XLA reads and writes around the mpi4jax transport's MPI calls in one call of
    ``algorithm`` (see :class:`Pricing`)."""
    model = CostModel(alpha=0.0, beta=0.0)
    return model.pricing(algorithm, size=size, nnz=capacity, nprocs=nprocs, transport="mpi4jax", capacity=capacity,
                         delta=delta).staged
