"""Bytes on the wire (AllreduceStats.bytes_sent) against SparCML's alpha-beta volumes (mpirun -n P).

Native transport: a message is a 16-byte header (not counted) plus either the valid pairs (8 bytes
each) or the dense slice (4 bytes per entry), whichever SparCML's rule picks, so the volume
follows the actual supports:

- SSAR_Recursive_double, identical supports of k pairs, P a power of two: 8 k log2(P) per rank;
  disjoint supports: 8 k (P - 1) (as long as no stream turns dense);
- split phases send each range's pairs to its owner; DSAR then allgathers dense slices.

mpi4jax transport: every message carries its whole static buffer, an 8-byte header
[nnz, status] plus 8 bytes per pair of capacity (or 4 per entry once the capacity is dense).

The expected numbers are simulated here from the schedules of SparCML's Algorithms 1-3 (fold /
unfold of the ranks past the lower power of two, ranges of N // P with the remainder in the last).
"""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
from _util import (
    COMM,
    NPROCS,
    QUANT_BUCKET,
    QUANT_CASES,
    RANK,
    TRANSPORTS,
    Inputs,
    agree_all,
    dense_threshold,
    part_bounds,
)

from sparcml_jax import ALGORITHMS, sparse_allgather, sparse_allreduce

N_SPARSE, CAP_SPARSE, K = 1000, 24, 24  # shares its programs with the other files' "sparse" case
N_DENSE = 1001  # capacity N: streams may switch to dense mid-schedule
HEADER = 8  # mpi4jax transport: [nnz, status] as int32


# ----------------------------------------------------------------------------- static capacities


def grown(capacity: int, size: int, fan_in: int) -> int:
    """Static capacity of the sum of ``fan_in`` streams: the union bound, or N once it may be dense."""
    union = min(capacity * fan_in, size)
    return size if min(union, size) >= dense_threshold(size) else union


def lengths(size: int) -> list[int]:
    return [hi - lo for lo, hi in (part_bounds(size, NPROCS, r) for r in range(NPROCS))]


# ----------------------------------------------------------------------------- expected volumes


def recursive_doubling_bytes(supports: list[np.ndarray], size: int, capacity: int, transport: str) -> list[float]:
    """Bytes each rank sends in SSAR_Recursive_double (Algorithm 1 with fold / unfold)."""
    p = NPROCS
    lower = 1 << (p.bit_length() - 1)
    extra = p - lower
    held = [set(s.tolist()) for s in supports]
    dense = [s.size == size for s in supports]  # the stream's representation, decided on the actual count
    sent = [0.0] * p

    def message(r: int, cap: int) -> float:
        if transport == "native":
            return 4.0 * size if dense[r] else 8.0 * len(held[r])
        return HEADER + (4.0 * size if cap >= size else 8.0 * cap)

    def receive(r: int, q: int, merged_capacity: int) -> None:
        held[r] |= held[q]
        dense[r] = dense[r] or dense[q] or (merged_capacity >= size and len(held[r]) >= dense_threshold(size))

    if extra:  # fold: rank lower + i sends to rank i
        for r in range(lower, p):
            sent[r] += message(r, capacity)
        for r in range(extra):
            receive(r, r + lower, grown(capacity, size, 2))
        capacity = grown(capacity, size, 2)
    distance = 1
    while distance < lower:
        outgoing = [message(r, capacity) for r in range(lower)]
        before = [(set(held[r]), dense[r]) for r in range(lower)]
        for r in range(lower):
            sent[r] += outgoing[r]
            partner = r ^ distance
            held[r] |= before[partner][0]
            dense[r] = dense[r] or before[partner][1] or (
                grown(capacity, size, 2) >= size and len(held[r]) >= dense_threshold(size))
        capacity = grown(capacity, size, 2)
        distance *= 2
    for r in range(extra):  # unfold: rank i sends the result to rank lower + i
        sent[r] += message(r, capacity)
    return sent


def split_phase_bytes(supports: list[np.ndarray], size: int, capacity: int, transport: str) -> tuple[list, list]:
    """(bytes each rank sends in the sparse reduce-scatter, the union count of each rank's range)."""
    p, lens = NPROCS, lengths(size)
    bounds = [part_bounds(size, p, r) for r in range(p)]
    union = np.unique(np.concatenate(supports))
    owned = [int(np.count_nonzero((union >= lo) & (union < hi))) for lo, hi in bounds]
    sent = []
    for me in range(p):
        s = supports[me]
        total = 0.0
        for r, (lo, hi) in enumerate(bounds):
            if r == me:
                continue
            if transport == "native":
                count = int(np.count_nonzero((s >= lo) & (s < hi)))
                # A range goes as its dense slice when the source is dense or the pairs are no cheaper.
                as_dense = s.size == size or (lens[r] > 0 and 8 * count >= 4 * lens[r])
                total += 4.0 * lens[r] if as_dense else 8.0 * count
            else:
                slot = max(min(capacity, length) for length in lens)
                total += HEADER + 8.0 * slot
        sent.append(total)
    return sent, owned


def expected_bytes(algorithm: str, inp: Inputs, transport: str, quantize_bits: int | None = None,
                   bucket_size: int = 1024) -> list[float]:
    size, capacity, p = inp.size, inp.capacity, NPROCS
    lens = lengths(size)
    if algorithm == "dense":  # MPI_Allreduce of float32[N], priced as reduce-scatter + allgather
        return [float(np.float32(2 * (p - 1) / p * 4 * size))] * p
    if algorithm == "ssar_recursive_doubling":
        return recursive_doubling_bytes(inp.supports, size, capacity, transport)
    rs, owned = split_phase_bytes(inp.supports, size, capacity, transport)
    if algorithm == "ssar_split_allgather":
        if transport == "native":
            part = [4.0 * L if L > 0 and owned[r] >= dense_threshold(L) else 8.0 * owned[r]
                    for r, L in enumerate(lens)]
            return [rs[r] + (p - 1) * part[r] for r in range(p)]
        slot = max(grown(min(capacity, L), L, p) for L in lens)
        return [rs[r] + (p - 1) * (HEADER + 8.0 * slot) for r in range(p)]
    if algorithm == "dsar_split_allgather":
        if quantize_bits is not None:  # QSGD codes of the largest range, plus one float32 scale per bucket
            slot = max(lens)
            wire = math.ceil(slot * quantize_bits / 8) + 4 * math.ceil(slot / bucket_size)
            return [rs[r] + (p - 1) * wire for r in range(p)]
        return [rs[r] + (p - 1) * 4.0 * max(lens) for r in range(p)]  # equal slots, both transports
    raise ValueError(algorithm)


# ----------------------------------------------------------------------------- tests


def on_rank_0(failures: list[str]) -> list[str]:
    """Failures of a check every rank makes on the same gathered numbers: reported once."""
    return failures if RANK == 0 else []


def sent_by_every_rank(inp: Inputs, **kwargs) -> tuple[list[float], list[str]]:
    """Runs the allreduce, checks the sum; returns every rank's bytes_sent (gathered) and this
    rank's failures. Comparisons of the gathered numbers are made (and reported) on rank 0 only."""
    failures = []
    try:
        out, stats = sparse_allreduce(inp.stream, return_stats=True, **kwargs)
        jax.block_until_ready(out)
        if kwargs.get("quantize_bits") is None and not np.array_equal(np.asarray(out.to_dense()), inp.total):
            failures.append(f"{kwargs} {inp}: wrong sum")
        sent = float(stats.bytes_sent)
    except Exception as e:  # noqa: BLE001
        failures.append(f"{kwargs} {inp}: {type(e).__name__}: {str(e)[:300]}")
        sent = float("nan")
    return [float(s) for s in COMM.allgather(sent)], failures


CASES = {  # name: (N, capacity, k, support kind)
    "identical": (N_SPARSE, CAP_SPARSE, K, "identical"),
    "disjoint": (N_SPARSE, CAP_SPARSE, K, "disjoint"),
    "unequal": (N_SPARSE, CAP_SPARSE, K, "unequal"),
    "dense_capacity": (N_DENSE, N_DENSE, 130 if NPROCS >= 4 else 300, "disjoint"),  # turns dense mid-way
    "dense_inputs": (N_DENSE, N_DENSE, N_DENSE, "random"),
}


def case_inputs(name: str) -> Inputs:
    size, capacity, k, kind = CASES[name]
    return Inputs(size, capacity, k, kind, seed=900 + list(CASES).index(name))


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("case", list(CASES))
def test_bytes_sent_match_the_schedule(case, transport, algorithm):
    inp = case_inputs(case)
    got, local = sent_by_every_rank(inp, algorithm=algorithm, transport=transport)
    want = expected_bytes(algorithm, inp, transport)
    failures = [] if got == want else [f"{algorithm}/{transport} {case}: bytes_sent per rank {got}, expected {want}"]
    agree_all(local + on_rank_0(failures), f"wire volume {algorithm}/{transport} {case}")


@pytest.mark.skipif(NPROCS & (NPROCS - 1) != 0 or NPROCS < 2, reason="the closed forms assume P = 2^j")
def test_recursive_doubling_native_closed_forms():
    """SparCML §5.2: identical supports cost 8 k log2 P bytes per rank, disjoint ones 8 k (P - 1)."""
    ident, f1 = sent_by_every_rank(case_inputs("identical"), algorithm="ssar_recursive_doubling")
    disj, f2 = sent_by_every_rank(case_inputs("disjoint"), algorithm="ssar_recursive_doubling")
    failures = []
    log_p = NPROCS.bit_length() - 1
    if ident != [8.0 * K * log_p] * NPROCS:
        failures.append(f"identical supports: {ident}, expected 8 k log2 P = {8 * K * log_p} on every rank")
    if disj != [8.0 * K * (NPROCS - 1)] * NPROCS:
        failures.append(f"disjoint supports: {disj}, expected 8 k (P-1) = {8 * K * (NPROCS - 1)} on every rank")
    if NPROCS >= 8 and not max(ident) * 2 < min(disj):
        failures.append(f"identical supports should send far less than disjoint ones: {ident[0]} vs {disj[0]}")
    agree_all(f1 + f2 + on_rank_0(failures), "recursive doubling closed forms")


@pytest.mark.skipif(NPROCS < 2, reason="one process sends nothing")
def test_mpi4jax_transport_sends_static_capacities():
    """mpi4jax moves whole buffers: the volume is the same for identical and disjoint supports."""
    ident, f1 = sent_by_every_rank(case_inputs("identical"), algorithm="ssar_recursive_doubling", transport="mpi4jax")
    disj, f2 = sent_by_every_rank(case_inputs("disjoint"), algorithm="ssar_recursive_doubling", transport="mpi4jax")
    failures = []
    if ident != disj:
        failures.append(f"mpi4jax volume depends on the supports: {ident} vs {disj}")
    if NPROCS & (NPROCS - 1) == 0:  # rounds of capacity 24, 48, 96, ...: header + 8 * capacity each
        want = sum(HEADER + 8.0 * CAP_SPARSE * 2 ** i for i in range(NPROCS.bit_length() - 1))
        if ident != [want] * NPROCS:
            failures.append(f"mpi4jax recursive doubling: {ident}, expected {want} on every rank")
    agree_all(f1 + f2 + on_rank_0(failures), "mpi4jax static volume")


@pytest.mark.parametrize("transport,quantize_bits", QUANT_CASES)
def test_quantized_dsar_sends_codes_and_scales(transport, quantize_bits):
    inp = case_inputs("dense_capacity")
    got, f1 = sent_by_every_rank(inp, algorithm="dsar_split_allgather", transport=transport,
                                 quantize_bits=quantize_bits, key=jax.random.key(0), bucket_size=QUANT_BUCKET)
    failures = []
    want = expected_bytes("dsar_split_allgather", inp, transport, quantize_bits=quantize_bits,
                          bucket_size=QUANT_BUCKET)
    if got != want:
        failures.append(f"quantized DSAR {quantize_bits} bits: {got}, expected {want}")
    plain, f2 = sent_by_every_rank(inp, algorithm="dsar_split_allgather", transport=transport)
    if NPROCS > 1 and not all(q < d for q, d in zip(got, plain)):
        failures.append(f"quantized DSAR should send less than float32 DSAR: {got} vs {plain}")
    agree_all(f1 + f2 + on_rank_0(failures), f"quantized DSAR volume ({quantize_bits} bits)")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_allgather_volume(transport):
    inp = case_inputs("unequal")
    failures = []
    out, stats = sparse_allgather(inp.stream, transport=transport, return_stats=True)
    local = [] if np.array_equal(np.asarray(out.to_dense()), inp.total) else ["wrong union"]
    got = [float(s) for s in COMM.allgather(float(stats.bytes_sent))]
    if transport == "native":
        want = [(NPROCS - 1) * (4.0 * inp.size if s.size == inp.size else 8.0 * s.size) for s in inp.supports]
    else:
        want = [(NPROCS - 1) * (HEADER + 8.0 * inp.capacity)] * NPROCS
    if got != want:
        failures.append(f"sparse_allgather/{transport}: {got}, expected {want}")
    agree_all(local + on_rank_0(failures), f"allgather volume {transport}")
