"""Bytes on the wire (AllreduceStats.bytes_sent, as each transport counts what it sends) against
the volumes derived from the algorithms' own definitions (mpirun -n P).

The expected numbers come from running the same definition on the simulated transport
(sparcml_jax/comm/simulated.py) with every rank's actual support: native messages carry 8 bytes
per pair or 4 per dense entry (headers excluded), whichever SparCML's rule picks; mpi4jax
messages carry their whole static buffer plus an 8-byte header [nnz, 0] (its dense allreduce
and DSAR run on the engine, as native). SparCML's closed forms
(recursive doubling: 8 k log2 P for identical supports, 8 k (P - 1) for disjoint ones) are
checked on their own as well.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
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
)

from sparcml_jax import ALGORITHMS, sparse_allgather, sparse_allreduce
from sparcml_jax.collectives._plan import ENGINE_ALGORITHMS, Quantization, definition
from sparcml_jax.comm.simulated import SimStream, Simulated

N_SPARSE, CAP_SPARSE, K = 1000, 24, 24  # shares its programs with the other files' "sparse" case
N_DENSE = 1001  # capacity N: streams may switch to dense mid-schedule
HEADER = 8  # mpi4jax transport: [nnz, 0] as int32


def simulated_bytes(algorithm: str, inp: Inputs, transport: str, value_bytes: int = 4, **options) -> list[float]:
    """Bytes each rank sends when the algorithm's definition runs on every rank's support."""
    ranks = []
    for support in inp.supports:
        if support.size == inp.size:
            ranks.append(SimStream(inp.size, inp.capacity, None, np.ones(inp.size, np.float32)))
        else:
            ranks.append(SimStream.pairs(inp.size, inp.capacity, support, np.ones(support.size)))
    # (On both MPI transports the dense-result algorithms run on the engine.)
    t = Simulated(NPROCS, inp.size, wire="native" if algorithm in ENGINE_ALGORITHMS else transport,
                  value_bytes=value_bytes)
    (definition(algorithm) if algorithm != "allgather" else lambda t, s: t.gather(s))(t, ranks, **options)
    return [float(np.float32(sent)) for sent in t.sent]


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
    want = simulated_bytes(algorithm, inp, transport)
    failures = [] if got == want else [f"{algorithm}/{transport} {case}: bytes_sent per rank {got}, expected {want}"]
    agree_all(local + on_rank_0(failures), f"wire volume {algorithm}/{transport} {case}")


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("case", list(CASES))
def test_bfloat16_values_on_the_wire(case, transport, algorithm):
    """value_dtype=bfloat16: every sum of these small integers is exact (bfloat16 holds them), and
    every message carries 2 bytes per value: 6 per pair, 2 per dense entry (static buffers: two
    values to an int32 slot)."""
    inp = case_inputs(case)
    got, local = sent_by_every_rank(inp, algorithm=algorithm, transport=transport, value_dtype=jnp.bfloat16)
    want = simulated_bytes(algorithm, inp, transport, value_bytes=2)
    failures = [] if got == want else [f"{algorithm}/{transport} {case}: bytes_sent per rank {got}, expected {want}"]
    agree_all(local + on_rank_0(failures), f"bfloat16 wire {algorithm}/{transport} {case}")


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
    want = simulated_bytes("dsar_split_allgather", inp, transport,
                           quantize=Quantization(quantize_bits, QUANT_BUCKET))
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
    want = simulated_bytes("allgather", inp, transport)
    if transport == "native" and want != [(NPROCS - 1) * (4.0 * inp.size if s.size == inp.size else 8.0 * s.size)
                                          for s in inp.supports]:
        failures.append(f"the simulation of sparse_allgather/native sends {want}: not every rank's pairs P - 1 times")
    if got != want:
        failures.append(f"sparse_allgather/{transport}: {got}, expected {want}")
    agree_all(local + on_rank_0(failures), f"allgather volume {transport}")
