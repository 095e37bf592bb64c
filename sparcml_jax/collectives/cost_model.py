"""The cost model behind ``algorithm="auto"`` (SparCML §5.3 and Appendix B).

A message of ``b`` bytes costs ``alpha + b * beta``. Result density follows the uniform union
bound: ``m`` streams of ``k`` random nonzeros out of ``N`` cover ``N (1 - (1 - k/N)^m)`` indices.
Pairs cost 8 bytes and dense values 4, so every stream is priced at ``min(8 nnz, 4 N)``. On top
of the paper's wire terms the model prices what dominates on a node: the dense allreduce as
measured, merges per pair, and passes over length-N buffers, all measured at calibration.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
import time

import numpy as np
from mpi4py import MPI

from sparcml_jax.comm.topology import (gathered_capacity, grown_capacity, largest_part_capacity, longest_part,
                                       lower_power_of_two, segment_slot)


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Time of one allreduce, from quantities measured on the communicator.

    Attributes:
      alpha: seconds per message (latency), from a ping-pong between ranks 0 and 1.
      beta: seconds per byte on the wire, from messages of 16 MB exchanged by all ranks in pairs
        at once, as in a round of recursive doubling (on a node the ranks' copies then share
        cores and the memory bus; on a network every link is busy): the median of 15. (Five
        exchanges of 4 MB, the earlier measure, gave 0.19-0.54 ns/B at P = 4 from one
        calibration to the next; 15 of 16 MB gave 0.22-0.33 in eleven calibrations.)
      dense_alpha, dense_beta: the dense MPI_Allreduce measured as a whole (a small one, and
        seconds per byte of the vector from the median of 15 of 16 MB, past the caches): on a
        node it is bound by memory and by the ranks sharing cores, not by the wire, and the
        SparCML algorithms must beat the real thing. (Five of 8 MB, the earlier measure, stayed
        partly in cache: 0.24 ns/B at P = 2 where 16 MB costs 0.29-0.31, so the model priced
        the dense baseline 1.4-1.55x below its time there; at P = 4 they gave 0.67-1.56 ns/B from
        one calibration to the next, 16 MB gave 0.77-0.99 in eleven.)
      pair_cost: seconds per (index, value) pair merged on a rank, from the merge kernel timed
        on streams of 4 MB (past the caches, like the messages that matter), two merges and a
        merge of their results as a collective chains them, on every rank at once (so ranks that
        share cores are measured sharing them and the memory bus): the slowest rank's median.
      element_cost: seconds per float32 element read or written by a pass over a length-N
        vector (densify, padding, a result buffer): half a jitted ``x * 2`` over 16 MB into a
        fresh buffer, measured the same way. (A write-only pass, ``iota``, took half as long.)
      call_overhead: what calling a collective from JAX adds around its MPI calls: a jitted
        mpi4jax allreduce of two floats minus the same MPI_Allreduce from mpi4py. It is mostly
        Python: JAX dispatches a program with an ordered effect on its Python path, never the C++
        fast path (170 us per call in one process here, 200 us per rank at P = 2, 550 at P = 4,
        called back to back; 0.4 and 1.1-1.6 ms timed as below).
      fixed_cost: what every sparse collective pays whatever it sends: a jitted program of just
        its agreement step (a small allgather) and its status check (a small allreduce).

    Both are timed as a collective is called in a training step: right after a computation that
    streamed megabytes through the caches (the backward pass; in the benchmark, the previous
    case). There the agreement program took 1.9-2.1 ms at P = 4, against 0.76 ms called back to
    back, and the model priced one-call collectives at up to 2.5x below their times.
    """

    alpha: float
    beta: float
    dense_alpha: float = 0.0
    dense_beta: float = 0.0
    pair_cost: float = 0.0
    element_cost: float = 0.0
    call_overhead: float = 0.0
    fixed_cost: float = 0.0

    @classmethod
    def calibrate(cls, comm: MPI.Comm, small_reps: int = 50, large_bytes: int = 16 << 20, large_reps: int = 15,
                  dense_bytes: int = 16 << 20) -> "CostModel":
        """Measures the model on ``comm``; every rank gets rank 0's numbers (identical choices)."""
        if comm.Get_size() < 2:
            return cls(alpha=0.0, beta=0.0)
        small = np.zeros(1, np.float64)
        _pairwise_exchange(comm, large_bytes, 2)  # MPICH sets up its large-message path on first use
        t_large = _pairwise_exchange(comm, large_bytes, large_reps)
        d_large = _allreduce_seconds(comm, dense_bytes // 4, large_reps)
        # Small operations on ranks that share cores run in phases: in a fresh process a whole
        # block of 50 small allreduces or ping-pongs took 1.3-1.4 ms each instead of 30 us. The
        # fastest of three blocks is the steady state.
        alpha = max(_steadiest(lambda: _ping_pong(comm, small, small_reps)), 1e-7)
        beta = max((t_large - alpha) / large_bytes, 1e-12)
        d_small = _steadiest(lambda: _allreduce_seconds(comm, 2, small_reps))
        dense_beta = max((d_large - d_small) / dense_bytes, 1e-12)
        pair_cost, element_cost = _compute_costs(comm)
        overhead = max(_jitted_seconds(comm, "allreduce") - d_small, 0.0)
        fixed = _jitted_seconds(comm, "agreement")
        numbers = (alpha, beta, d_small, dense_beta, pair_cost, element_cost, overhead, fixed)
        return cls(*comm.bcast(numbers, root=0))

    def latency(self, nprocs: int) -> float:
        """Seconds per round in which every rank communicates at once.

        The ping-pong's alpha, but no less than a round of the small dense allreduce (which
        takes log2 P of them): when ranks share cores, a message waits for its receiver to be
        scheduled, which a ping-pong between two ranks does not see.
        """
        return max(self.alpha, self.dense_alpha / max(1.0, math.log2(nprocs)))

    def message(self, nbytes, nprocs: int = 2):
        return self.latency(nprocs) + nbytes * self.beta

    def predict(self, algorithm: str, *, size: int, nnz, nprocs: int, transport: str = "native",
                capacity: int | None = None, quantize_bits: int | None = None, delta: float = 1.0, xp=np):
        """Predicted seconds of one allreduce; ``nnz`` is the largest per-rank count (scalar or traced)."""
        if nprocs == 1:
            return xp.asarray(0.0)
        return self.fixed_cost + self._communication(
            algorithm, size=size, nnz=nnz, nprocs=nprocs, transport=transport, capacity=capacity,
            quantize_bits=quantize_bits, delta=delta, xp=xp)

    def dense_baseline(self, size: int, nprocs: int) -> float:
        """Predicted seconds of :func:`sparcml_jax.dense_allreduce` of ``size`` float32, jitted."""
        if nprocs == 1:
            return 0.0
        return self.call_overhead + self.dense_alpha + 4.0 * size * self.dense_beta

    def _communication(self, algorithm: str, *, size: int, nnz, nprocs: int, transport: str,
                       capacity: int | None, quantize_bits: int | None, delta: float, xp):
        n, p = float(size), nprocs
        static = transport == "mpi4jax"
        k = xp.asarray(float(capacity) if static and capacity is not None else nnz, dtype=xp.float32)
        dense_bytes = 4.0 * n

        def union(m):
            return n * (1.0 - (1.0 - xp.minimum(k, n) / max(n, 1.0)) ** m)

        def count(m):
            return xp.minimum(k * m, n) if static else union(m)

        def stream_bytes(m):
            return xp.minimum(8.0 * count(m), dense_bytes)

        def merge(m, inputs_capacity, out_capacity):
            """Merging two streams of m-fold unions. Streams held in fewer than N slots are pairs
            however full (the kernel visits the valid ones; a result that turns dense is then
            densified in place); only streams of N slots can be dense vectors, added in one pass.
            (Pricing every stream past the threshold as dense put SSAR at 50 % at 2.0-2.8x below
            its time: there the first merge is of two streams of N / 2 pairs.)"""
            if inputs_capacity >= n:
                dense_inputs = 8.0 * union(m) >= dense_bytes
                return xp.where(dense_inputs, 3 * n * self.element_cost, 2 * union(m) * self.pair_cost)
            densify = xp.where(8.0 * union(2 * m) >= dense_bytes, 2 * n * self.element_cost, 0.0)
            return 2 * union(m) * self.pair_cost + (densify if out_capacity >= n else 0.0)

        def result_buffers(cap):  # a result of capacity N: fresh length-N index and value buffers
            return 2 * n * self.element_cost if cap >= n else 0.0

        cap = size if capacity is None else capacity
        log_p = math.log2(p)
        staged = 0.0
        if static and algorithm != "dense":
            staged = staged_elements(algorithm, size=size, nprocs=p, capacity=cap, delta=delta) * self.element_cost
        if algorithm == "dense":  # densify into the result, MPI_Allreduce in place, indices 0..N-1
            # mpi4jax densifies into a zero-filled XLA buffer first (measured at P = 4, N = 2^22,
            # 10 %: 24.3 ms against 17.4 ms for the allreduce of a ready dense vector).
            densify = 2 * n * self.element_cost if static else 0.0
            return self.dense_alpha + dense_bytes * self.dense_beta + result_buffers(size) + densify
        if algorithm == "ssar_recursive_doubling":
            lower = lower_power_of_two(p)
            folded = 2 if lower < p else 1
            cost = 0.0
            if lower < p:
                grown = grown_capacity(cap, size, 2, delta)
                cost = cost + self.message(stream_bytes(1), p) + self.message(stream_bytes(p), p) + merge(1, cap, grown)
                cap = grown
            m = folded
            while m < folded * lower:
                grown = grown_capacity(cap, size, 2, delta)
                cost = cost + self.message(stream_bytes(m), p) + merge(m, cap, grown) + result_buffers(grown)
                cap, m = grown, m * 2
            return cost + staged
        sends = (p - 1) * self.message(stream_bytes(1) / p, p)  # range r of every stream to rank r
        if static:  # every segment and part travels at its whole capacity
            slot = segment_slot(cap, size, p)
            part = largest_part_capacity(cap, size, p, delta)
            sends = (p - 1) * self.message(8.0 * slot, p)
        # What arrives is merged segment after segment into the growing part: the part's pairs
        # are visited (P + 1) / 2 times on average.
        split_phase = sends + (p + 1) / 2 * union(1) * self.pair_cost
        if algorithm == "ssar_split_allgather":
            gather = log_p * self.latency(p) + (p - 1) * (8.0 * part if static else stream_bytes(p) / p) * self.beta
            return (split_phase + gather + union(p) * self.pair_cost + staged
                    + result_buffers(gathered_capacity(cap, size, p, delta)))
        if algorithm == "dsar_split_allgather":
            # The dense allgather moves half the bytes of a dense allreduce. (Measured on shared
            # memory it cost as much as the whole allreduce while XLA's fresh result buffers
            # page-faulted; with freed memory kept in the heap, see the Makefile, it costs half.)
            value_bytes = 4.0 if quantize_bits is None else quantize_bits / 8.0
            gather = log_p * self.latency(p) + n * value_bytes * self.dense_beta / 2
            if quantize_bits is None and not static:
                # The segments are added into a zero-filled slice of N / P values; the gather
                # writes the result's values itself, and only its indices 0..N-1 are written after.
                # (Pricing two whole passes and both result buffers here predicted 16-25 ms where
                # it measured 12-15 ms at N = 2^22, 10 %, P = 4.) Every pair of the stream is
                # packed into its range's message and added into its owner's slice: about a merge's
                # work per pair (without it DSAR at 50 % was priced at a third of its time).
                return sends + gather + (1 / p + 1) * n * self.element_cost + union(1) * self.pair_cost
            if static:  # the segments are merged as pairs, then densified, padded and concatenated
                qsgd = 0.0 if quantize_bits is None else 4 * n * self.element_cost
                return split_phase + gather + staged + qsgd + result_buffers(size)
            return sends + gather + 4 * n * self.element_cost + result_buffers(size)  # QSGD: code, decode
        raise ValueError(f"unknown algorithm {algorithm!r}")


def staged_elements(algorithm: str, *, size: int, nprocs: int, capacity: int, delta: float = 1.0) -> int:
    """Elements that XLA reads and writes around the mpi4jax transport's MPI calls in one of the
    SparCML algorithms, for the slowest rank: padding, packing and slicing whole static buffers,
    re-basing indices. The native transport stages nothing (its FFI ops read and write XLA's
    buffers in place); the dense algorithm's densify pass is priced with the algorithm.

    The coefficients are XLA's own count, ``compiled.cost_analysis()["bytes accessed"] / 4`` of
    the transport's ops (tests/mpi/test_cost_model.py checks them against it at P = 2..8).
    Without them the model priced split-allgather on this transport at 2.5-8x below its time.
    """
    n, p, c = size, nprocs, capacity
    if algorithm == "ssar_recursive_doubling":
        def exchange(cap, send=True, receive=True):
            if cap >= n:  # the compact message of n slots: pairs or dense values, chosen at run time
                return 9 * n * send + 4 * n * receive
            return 0  # header, indices and values travel straight from and into XLA's buffers

        lower = lower_power_of_two(p)
        folded = grown_capacity(c, n, 2, delta) if lower < p else c
        rounds, cap = 0, folded
        for _ in range(lower.bit_length() - 1):
            rounds += exchange(cap)
            cap = grown_capacity(cap, n, 2, delta)
        if lower == p:
            return rounds
        receiver = exchange(c, send=False) + rounds + exchange(cap, receive=False)
        padded = (2 * folded + 2 * c if folded > c else 0) + rounds  # pads its own stream instead
        extra = exchange(c, receive=False) + exchange(cap, send=False)
        return max(receiver, padded, extra)
    longest = longest_part(n, p)
    slot = segment_slot(c, n, p)
    scatter = 5 * c + 2 * slot + 12 * p * slot  # P segments cut, packed, sent and unpacked
    if algorithm == "ssar_split_allgather":
        part = largest_part_capacity(c, n, p, delta)
        return scatter + 4 * part + 6 * p * part  # P parts packed, gathered, re-based
    if algorithm == "dsar_split_allgather":
        # The part densified, the gathered slices concatenated; unequal parts are padded to the
        # longest for the allgather and cut back after.
        unequal = n % p != 0  # the last range takes the remainder
        return scatter + 2 * n + longest * (1 + 2 * unequal)
    raise ValueError(f"unknown algorithm {algorithm!r}")


def _steadiest(measure, tries: int = 3) -> float:
    return min(measure() for _ in range(tries))


def _on_fresh_thread(measure):
    """Runs ``measure()`` on a fresh thread. The first collective on a communicator usually runs
    while the user's train step is being traced, and JAX's trace state is per thread: on a fresh
    thread the kernels run as they would in a step, where inside the trace (even under
    ensure_compile_time_eval) every call took 10x as long."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(measure).result()


def _slowest_rank_median(comm: MPI.Comm, run, reps: int, before=None) -> float:
    """Median over ``reps`` calls of ``run()`` (after one warm-up) of the slowest rank's time,
    every call started by all ranks together after a barrier (and after ``before()``, untimed)."""
    times = []
    for _ in range(reps + 1):
        if before is not None:
            before()
        comm.Barrier()
        start = time.perf_counter()
        run()
        times.append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
    return float(np.median(times[1:]))


def _allreduce_seconds(comm: MPI.Comm, count: int, reps: int = 5) -> float:
    """Median time of an MPI_Allreduce of ``count`` float32 (max over ranks)."""
    buf, out = np.ones(count, np.float32), np.empty(count, np.float32)
    return _slowest_rank_median(comm, lambda: comm.Allreduce(buf, out, op=MPI.SUM), reps)


def _jitted_seconds(comm: MPI.Comm, program: str, reps: int = 15) -> float:
    """Slowest rank's median time of a small jitted program, each call right after a jitted pass
    over 16 MB (see :class:`CostModel`), the steadiest of three blocks: ``"allreduce"``, an
    mpi4jax allreduce of two floats, or ``"agreement"``, the agreement step and status check of a
    sparse collective on an empty stream."""
    import jax
    import jax.numpy as jnp
    import mpi4jax

    from sparcml_jax.collectives._agree import signature
    from sparcml_jax.comm import native
    from sparcml_jax.stream import SparseStream

    def agreement(s: SparseStream):
        summary = native.summary(s, comm=comm, signature=signature("allreduce", size=s.size))
        native.check(summary[0] * 0, comm=comm)
        return summary

    def measure() -> float:  # everything on the fresh thread: here jnp.ones would be a tracer
        if program == "allreduce":
            call, arg = jax.jit(lambda x: mpi4jax.allreduce(x, op=MPI.SUM, comm=comm)), jnp.ones(2, jnp.float32)
        else:
            call, arg = jax.jit(agreement), SparseStream.empty(1, 1)
        evict, vector = _pass_program(), jnp.ones(1 << 22, jnp.float32)
        return _steadiest(lambda: _slowest_rank_median(comm, lambda: jax.block_until_ready(call(arg)), reps,
                                                       before=lambda: jax.block_until_ready(evict(vector))))

    return _on_fresh_thread(measure)


@functools.cache
def _pass_program():
    """A pass as the collectives make them: XLA reads a vector into a fresh buffer. It prices a
    pass per element and evicts the caches before the small programs are timed (one program,
    compiled once for both)."""
    import jax

    return jax.jit(lambda v: v * 2.0)


def _compute_costs(comm: MPI.Comm) -> tuple[float, float]:
    """Per-pair merge cost and per-element pass cost, each the slowest rank's median with every
    rank running at once, so that ranks sharing a core or the memory bus are measured sharing
    them. Both work on megabytes, past the caches, as the collectives that matter do."""
    import jax
    import jax.numpy as jnp

    from sparcml_jax.kernels.merge import merge
    from sparcml_jax.stream import SparseStream

    n, k = 1 << 23, 1 << 19
    rng = np.random.default_rng(0)

    def stream():  # one random index per stride: sorted and distinct, at density 1/16
        stride = n // k
        idx = (np.arange(k) * stride + rng.integers(0, stride, k)).astype(np.int32)
        return SparseStream(jnp.asarray(idx), jnp.ones(k, jnp.float32), jnp.int32(k), n)

    # Merges as a collective chains them: two merges, then a merge of their fresh results. (One
    # merge alone came out at 1.9-3.9 ns per pair at P = 4 from one calibration to the next,
    # the chain at 3.0-3.9, like recursive doubling's merges inside the collective.)
    merged = jax.jit(lambda a, b, c, d: merge(merge(a, b), merge(c, d)).values)
    # A pass over 16 MB. (An in-place numpy pass on 4 MB, the earlier measure, stayed in cache:
    # 0.05-0.09 ns per element where this pass takes 0.55 ns per element at P = 2 and 1.05 ns at
    # P = 4, so auto priced densify and padding passes 5x too low and chose mpi4jax's dense path
    # at 10 %.)
    doubled = _pass_program()

    def time_both():
        inputs, vector = [stream() for _ in range(4)], jnp.ones(1 << 22, jnp.float32)
        for _ in range(8):  # the heaps grow on the first calls (page faults, 3-4x slower)
            jax.block_until_ready((merged(*inputs), doubled(vector)))
        # Every sample starts on all ranks at once. (Timed rank by rank after one warm-up call,
        # the cost came out 1.9 or 5.5 ns per pair at P = 4 from one calibration to the next.)
        chain_seconds = _slowest_rank_median(comm, lambda: jax.block_until_ready(merged(*inputs)), 11)
        pass_seconds = _slowest_rank_median(comm, lambda: jax.block_until_ready(doubled(vector)), 11)
        # The chain reads 2k + 2k + 4k pairs; a pass reads and writes each element.
        return chain_seconds / (8 * k), pass_seconds / (2 * vector.size)

    return _on_fresh_thread(time_both)


def _pairwise_exchange(comm: MPI.Comm, nbytes: int, reps: int) -> float:
    """Median time (max over ranks) of every rank exchanging ``nbytes`` with rank ^ 1 at once."""
    partner = comm.Get_rank() ^ 1
    send, recv = np.ones(nbytes // 8, np.float64), np.empty(nbytes // 8, np.float64)

    def exchange():
        if partner < comm.Get_size():
            comm.Sendrecv(send, dest=partner, sendtag=78, recvbuf=recv, source=partner, recvtag=78)

    return _slowest_rank_median(comm, exchange, reps)


def _ping_pong(comm: MPI.Comm, buf: np.ndarray, reps: int) -> float:
    """Median one-way time of ``buf`` between ranks 0 and 1 (other ranks wait at the barrier)."""
    rank = comm.Get_rank()
    times = []
    comm.Barrier()
    for _ in range(reps + 1):
        start = time.perf_counter()
        if rank == 0:
            comm.Send(buf, dest=1, tag=77)
            comm.Recv(buf, source=1, tag=77)
        elif rank == 1:
            comm.Recv(buf, source=0, tag=77)
            comm.Send(buf, dest=0, tag=77)
        times.append((time.perf_counter() - start) / 2)
    comm.Barrier()
    return float(np.median(times[1:]))
