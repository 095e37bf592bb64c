"""Multi-rank correctness of sparse_allreduce / sparse_allgather (run under mpirun -n P).

Oracle: integer-valued float32 inputs, gathered with mpi4py and summed with numpy. Any summation
order gives the same float32 bits for these values, so every algorithm must match BIT FOR BIT.

Compilation dominates the runtime, so each (algorithm, transport, configuration) compiles once:
every stream of a configuration has the same static capacity and only the actual nnz varies
(which also exercises the dynamic dense switch). The full density x support grid runs at
P <= 4 and a representative subset at P = 5 and 8.
"""

from __future__ import annotations

import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _util import (
    ALGORITHMS_AND_AUTO,
    COMM,
    NPROCS,
    QUANT_BUCKET,
    QUANT_CASES,
    RANK,
    TRANSPORTS,
    Inputs,
    agree_all,
    check_identical_on_all_ranks,
    check_well_formed,
    count_for,
    dense_threshold,
    expected_nnz,
    part_bounds,
    run_and_agree,
)

from sparcml_jax import (ALGORITHMS, SparseStream, from_dense, nonzeros_allreduce, sparse_allgather, sparse_allreduce,
                         sparse_allreduce_start, sparse_allreduce_wait)

from sparcml_jax.collectives._plan import Plan
from sparcml_jax.collectives.auto import best, choice_table
from sparcml_jax.collectives.cost_model import CostModel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the references
from quantized_dsar_reference import quantized_dsar_reference, split_phase_error  # noqa: E402


DENSITIES = (0.0, 1e-4, 1e-3, 1e-2, 0.1, 0.5, 1.0)
SUPPORTS = ("random", "identical", "unequal", "nested")

# name: (N, capacity, densities). N = 1001 divides by none of 2, 3, 4, 5, 8; N = 1000 not by 3;
# N = 3 is smaller than P = 4, 5, 8 (empty ranges on most ranks).
CONFIGS = {
    "full": (1001, 1001, DENSITIES),  # capacity N: from empty to fully dense inputs
    "sparse": (1000, 24, DENSITIES[:4]),  # small fixed capacity: k = 0, 1, 1, 10 pairs
    "tiny": (3, 3, (0.0, 0.3, 0.6, 1.0)),  # k = 0, 1, 2, 3
}


def grid(config: str) -> list[tuple[float, str]]:
    """(density, support kind) pairs of a configuration: all at P <= 4, a subset at P = 5 and 8."""
    _, _, densities = CONFIGS[config]
    if NPROCS <= 4:
        return [(d, kind) for d in densities for kind in SUPPORTS]
    # Every density once, every support kind at least twice, edge cases (empty, dense) kept.
    return [(d, SUPPORTS[i % len(SUPPORTS)]) for i, d in enumerate(densities)] + [
        (densities[-1], "unequal"), (densities[len(densities) // 2], "identical")]


@functools.cache
def inputs(config: str, density: float, kind: str) -> Inputs:
    size, capacity, densities = CONFIGS[config]
    seed = 1000 * list(CONFIGS).index(config) + 10 * densities.index(density) + SUPPORTS.index(kind)
    return Inputs(size, capacity, count_for(density, size), kind, seed)


def bits(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).view(np.uint32)


def check_result(label: str, algorithm: str, inp: Inputs, out: SparseStream, stats, scale: float = 1.0,
                 transport: str = "native") -> list[str]:
    """Sum, representation, stats and well-formedness of one result (no communication)."""
    failures = []
    got = np.asarray(out.to_dense())
    want = inp.total * np.float32(scale)
    if not np.array_equal(bits(got), bits(want)):
        bad = np.flatnonzero(bits(got) != bits(want))
        failures.append(f"{label}: sum differs at {bad.size} indices, e.g. {bad[:5].tolist()}: "
                        f"got {got[bad[:5]].tolist()} want {want[bad[:5]].tolist()}")
    failures += check_well_formed(out, label)
    chosen = ALGORITHMS[int(stats.algorithm)] if int(stats.algorithm) in range(len(ALGORITHMS)) else None
    if NPROCS > 1 and chosen in ("dense", "dsar_split_allgather") and algorithm != "auto" and \
            not out.dense_by_construction:
        failures.append(f"{label}: a dense allreduce's result carries an index array of {out.indices.size}")
    nnz = int(out.nnz)
    if algorithm != "auto":
        want_nnz = expected_nnz(algorithm, inp, out.capacity)
        if nnz != want_nnz:
            failures.append(f"{label}: nnz={nnz}, expected {want_nnz} (union {inp.union.size}, dense threshold "
                            f"{dense_threshold(inp.size)}, result capacity {out.capacity})")
    code = int(stats.algorithm)
    if algorithm == "auto":
        if code not in range(len(ALGORITHMS)):
            failures.append(f"{label}: stats.algorithm={code} is not an index into ALGORITHMS")
    elif code != ALGORITHMS.index(algorithm):
        failures.append(f"{label}: stats.algorithm={code}, expected {ALGORITHMS.index(algorithm)}")
    if int(stats.result_nnz) != nnz:
        failures.append(f"{label}: stats.result_nnz={int(stats.result_nnz)} != result nnz {nnz}")
    sent = float(stats.bytes_sent)
    if not (np.isfinite(sent) and sent >= 0):
        failures.append(f"{label}: stats.bytes_sent={sent}")
    if NPROCS == 1 and sent != 0:
        failures.append(f"{label}: one process sent {sent} bytes")
    if int(stats.dense_round) < -1:
        failures.append(f"{label}: stats.dense_round={int(stats.dense_round)}")
    return failures


# ----------------------------------------------------------------------------- outside jit


def outside_jit_configs() -> list[str]:
    """Compiles at P = 5 and 8 take several seconds each (more ranks than cores): there the "tiny"
    configuration runs inside the user's jit only (test_allreduce_inside_user_jit)."""
    return list(CONFIGS) if NPROCS <= 4 else ["full", "sparse"]


def outside_jit_cases() -> list[tuple[str, str, str]]:
    cases = [(c, t, a) for c in outside_jit_configs() for t in TRANSPORTS for a in ALGORITHMS_AND_AUTO]
    if NPROCS > 4:  # the run-time choice compiles every algorithm again: at P > 4 it runs on "tiny" in jit only
        cases.remove(("full", "mpi4jax", "auto"))
    return cases


@pytest.mark.parametrize("config,transport,algorithm", outside_jit_cases())
def test_allreduce_matches_numpy_sum(config, transport, algorithm):
    failures = []
    for density, kind in grid(config):
        inp = inputs(config, density, kind)
        label = f"{algorithm}/{transport} d={density} {inp}"
        out = None
        try:
            out, stats = sparse_allreduce(inp.stream, algorithm=algorithm, transport=transport, return_stats=True)
            jax.block_until_ready((out, stats))
            failures += check_result(label, algorithm, inp, out, stats, transport=transport)
        except Exception as e:  # noqa: BLE001 - reported collectively below
            failures.append(f"{label}: {type(e).__name__}: {str(e)[:300]}")
            out = None
        # Collective steps, taken by every rank (also after a failure) to stay in lockstep.
        failures += check_identical_on_all_ranks(out, label)
        if algorithm == "auto":
            choices = COMM.allgather(None if out is None else int(stats.algorithm))
            if len(set(choices)) != 1 or None in choices:
                failures.append(f"{label}: ranks chose different algorithms {choices}")
            else:  # auto must be exactly the algorithm it reports
                failures += compare_with_explicit(label, inp, transport, ALGORITHMS[choices[0]], out, stats)
    agree_all(failures, f"sparse_allreduce {algorithm}/{transport} on {config}")


def dense_input_cases() -> list[tuple[str, str]]:
    algorithms = ALGORITHMS_AND_AUTO if NPROCS <= 4 else ("dense", "dsar_split_allgather", "auto")
    return [(t, a) for t in TRANSPORTS for a in algorithms]


@pytest.mark.parametrize("transport,algorithm", dense_input_cases())
def test_allreduce_of_a_stream_dense_by_construction(transport, algorithm):
    """A stream without an index array (SparseStream.dense): every algorithm on both transports,
    and the non-blocking engine; the dense allreduce reduces it from where it lies."""
    inp = Inputs(1001, 1001, 1001, "random", seed=77)
    stream = SparseStream.dense(jnp.asarray(inp.x))
    label = f"{algorithm}/{transport} dense by construction {inp}"
    failures, out = [], None
    try:
        out, stats = sparse_allreduce(stream, algorithm=algorithm, transport=transport, return_stats=True)
        jax.block_until_ready((out, stats))
        failures += check_result(label, algorithm, inp, out, stats, transport=transport)
        if transport == "native":
            waited, waited_stats = sparse_allreduce_wait(sparse_allreduce_start(stream, algorithm=algorithm),
                                                         return_stats=True)
            failures += check_result(f"{label} (start/wait)", algorithm, inp, waited, waited_stats)
    except Exception as e:  # noqa: BLE001 - reported collectively below
        failures.append(f"{label}: {type(e).__name__}: {str(e)[:300]}")
        out = None
    failures += check_identical_on_all_ranks(out, label)
    agree_all(failures, f"sparse_allreduce of a dense stream, {algorithm}/{transport}")


def nonzeros_inputs() -> list[Inputs]:
    """The "full" grid, and vectors of several 4096-entry blocks (the engine stops counting once a
    count reaches the dense threshold) with counts just below, at and above it."""
    n = 3 * 4096 + 5
    near = [Inputs(n, n, k, kind, seed=500 + k % 7) for k, kind in
            ((dense_threshold(n) - 1, "random"), (dense_threshold(n), "identical"), (n, "unequal"))]
    return [inputs("full", d, kind) for d, kind in grid("full")] + near


def nonzeros_cases() -> list[tuple[str, str]]:
    """Every algorithm on the engine at P = 4; elsewhere the run-time choice, whose branches take
    the vector as it lies (dense) or compacted (the algorithms' programs are sparse_allreduce's,
    checked at every P; on mpi4jax only the dense allreduce and DSAR take the vector itself)."""
    if NPROCS == 4:
        return [("native", a) for a in ALGORITHMS_AND_AUTO] + [("mpi4jax", "auto"), ("mpi4jax", "dense")]
    return [("native", "auto"), ("mpi4jax", "auto")]


@pytest.mark.parametrize("transport,algorithm", nonzeros_cases())
def test_nonzeros_allreduce_is_the_allreduce_of_from_dense(transport, algorithm):
    """nonzeros_allreduce(x) sums x exactly, and runs what sparse_allreduce(from_dense(x)) runs:
    the same algorithm, the same bytes and the same result count, whichever layout the engine
    gives x (counted on the engine, compacted only below the dense threshold)."""
    failures = []
    for inp in nonzeros_inputs():
        label = f"nonzeros_allreduce {algorithm}/{transport} {inp}"
        total = None
        try:
            x = jnp.asarray(inp.x)
            total, stats = nonzeros_allreduce(x, algorithm=algorithm, transport=transport, return_stats=True)
            ref, ref_stats = sparse_allreduce(from_dense(x), algorithm=algorithm, transport=transport,
                                              return_stats=True)
            if not np.array_equal(bits(total), bits(inp.total)):
                failures.append(f"{label}: differs from the numpy sum at {np.flatnonzero(bits(total) != bits(inp.total)).size} indices")
            for field in ("algorithm", "bytes_sent", "result_nnz"):
                got, want = float(getattr(stats, field)), float(getattr(ref_stats, field))
                if got != want:
                    failures.append(f"{label}: stats.{field}={got}, from_dense's stream gives {want}")
            if int(ref.nnz) != int(stats.result_nnz):
                failures.append(f"{label}: result_nnz={int(stats.result_nnz)}, the stream's sum has {int(ref.nnz)}")
        except Exception as e:  # noqa: BLE001 - reported collectively below
            failures.append(f"{label}: {type(e).__name__}: {str(e)[:300]}")
            total = None
        everyone = [t for t in COMM.allgather(None if total is None else bits(total).tobytes()) if t is not None]
        if any(t != everyone[0] for t in everyone):
            failures.append(f"{label}: the ranks' sums differ")
    agree_all(failures, f"nonzeros_allreduce {algorithm}/{transport}")


@pytest.mark.parametrize("transport,value_dtype", [("native", None), ("native", jnp.bfloat16), ("mpi4jax", None)])
def test_nonzeros_allreduce_of_bfloat16_vectors(transport, value_dtype):
    """A bfloat16 vector's sum (or mean) is the float32 one of its values, rounded once to
    bfloat16, bit for bit, on fractional values; empty, sparse and dense vectors alike."""
    failures = []
    densities = CONFIGS["full"][2]
    for inp in [inputs("full", densities[0], "random"), inputs("full", densities[-1], "unequal")] + \
            nonzeros_inputs()[-3:]:
        x = jnp.asarray(inp.x * np.float32(1.0 / 3.0) + np.where(inp.x != 0, np.float32(1e-3), np.float32(0)))
        x = x.astype(jnp.bfloat16)
        for average in (False, True):
            label = f"bfloat16 nonzeros_allreduce {transport} value_dtype={value_dtype} average={average} {inp}"
            out = None
            try:
                out = nonzeros_allreduce(x, transport=transport, value_dtype=value_dtype, average=average)
                wide = nonzeros_allreduce(x.astype(jnp.float32), transport=transport, value_dtype=value_dtype)
                want = np.asarray((wide / NPROCS if average else wide).astype(jnp.bfloat16)).view(np.uint16)
                if out.dtype != jnp.bfloat16:
                    failures.append(f"{label}: returned {out.dtype}")
                elif not np.array_equal(np.asarray(out).view(np.uint16), want):
                    failures.append(f"{label}: {np.count_nonzero(np.asarray(out).view(np.uint16) != want)} entries "
                                    "differ from the float32 result rounded")
            except Exception as e:  # noqa: BLE001
                failures.append(f"{label}: {type(e).__name__}: {str(e)[:300]}")
            mine = None if out is None else np.asarray(out).view(np.uint16).tobytes()
            if len({t for t in COMM.allgather(mine) if t is not None}) > 1:
                failures.append(f"{label}: the ranks' results differ")
    agree_all(failures, f"bfloat16 nonzeros_allreduce {transport}")


def test_nonzeros_allreduce_inside_user_jit():
    inp = inputs("full", 0.1, "unequal")
    total = jax.jit(lambda x: nonzeros_allreduce(x) * 2)(jnp.asarray(inp.x))
    agree_all([] if np.array_equal(bits(total), bits(inp.total * 2)) else ["nonzeros_allreduce under jit: wrong sum"],
              "nonzeros_allreduce under jit")


@pytest.mark.skipif(NPROCS < 2, reason="one process has one group")
def test_a_communicator_on_a_freed_ones_handle_sums_over_its_own_group():
    """MPI gives a freed communicator's handle to the next one (MPICH does at once), whose group
    may differ: the native channels, the compiled programs and auto's model must not carry over."""
    from sparcml_jax.comm import communicator_id

    n = 16
    x = np.zeros(n, np.float32)
    x[RANK % n] = RANK + 1
    stream = from_dense(jnp.asarray(x))

    def sums(comm, expected):
        failures = []
        for transport in TRANSPORTS:
            out = sparse_allreduce(stream, comm=comm, transport=transport, algorithm="ssar_recursive_doubling")
            if not np.array_equal(np.asarray(out.to_dense()), expected):
                failures.append(f"{transport}: {np.asarray(out.to_dense()).tolist()}, expected {expected.tolist()}")
        started = sparse_allreduce_wait(sparse_allreduce_start(stream, comm=comm, algorithm="ssar_recursive_doubling"))
        if not np.array_equal(np.asarray(started.to_dense()), expected):
            failures.append(f"non-blocking: {np.asarray(started.to_dense()).tolist()}")
        return failures

    def group_sum(comm):
        return np.sum(comm.allgather(x), axis=0)

    def run():
        first = COMM.Dup()
        failures = sums(first, group_sum(first))
        first_id = communicator_id(first)
        first.Free()
        second = COMM.Split(RANK % 2, RANK)  # {even ranks}, {odd ranks}: not the freed group
        try:
            if communicator_id(second) == first_id:
                failures.append("the new communicator took the freed one's identity")
            return failures + [f"new group: {f}" for f in sums(second, group_sum(second))]
        finally:
            second.Free()

    run_and_agree(run, "a communicator on a freed one's handle")


def compare_with_explicit(label: str, inp: Inputs, transport: str, chosen: str, out: SparseStream, stats) -> list[str]:
    try:
        ref, ref_stats = sparse_allreduce(inp.stream, algorithm=chosen, transport=transport, return_stats=True)
        failures = []
        if int(ref.nnz) != int(out.nnz) or not np.array_equal(bits(ref.to_dense()), bits(out.to_dense())):
            failures.append(f"{label}: differs from {chosen}, the algorithm it reports")
        if float(ref_stats.bytes_sent) != float(stats.bytes_sent):
            failures.append(f"{label}: sent {float(stats.bytes_sent)} bytes, {chosen} sends "
                            f"{float(ref_stats.bytes_sent)}")
        return failures
    except Exception as e:  # noqa: BLE001
        return [f"{label}: explicit {chosen}: {type(e).__name__}: {str(e)[:300]}"]


@pytest.mark.skipif(NPROCS < 2, reason="one process exchanges nothing")
def test_mpi4jax_recursive_doubling_decides_dense_on_actual_count():
    """Minimal reproducer: one or two nonzeros per rank in streams of capacity N = 1001."""
    inp = inputs("full", 1e-3, "random")
    out = sparse_allreduce(inp.stream, algorithm="ssar_recursive_doubling", transport="mpi4jax")
    want = expected_nnz("ssar_recursive_doubling", inp, out.capacity)
    assert want < inp.size
    agree_all([] if int(out.nnz) == want else [f"nnz={int(out.nnz)}, union of the supports {want}"],
              "mpi4jax recursive doubling: dense switch on the actual count")


# ----------------------------------------------------------------------------- inside a user's jit


_traces: dict[tuple, int] = {}


@functools.cache
def user_step(config: str, transport: str, algorithm: str):
    """A user's jitted step: some arithmetic around the allreduce (exact: doubling integers)."""
    key = (config, transport, algorithm)

    @jax.jit
    def step(s: SparseStream):
        _traces[key] = _traces.get(key, 0) + 1
        doubled = SparseStream(s.indices, s.values * 2, s.nnz, s.size)
        out, stats = sparse_allreduce(doubled, algorithm=algorithm, transport=transport, return_stats=True)
        return out, stats, out.to_dense().sum()

    return step


def jit_configs() -> list[str]:
    """One configuration per P (compiling a second copy of every program costs as much again)."""
    return [{1: "full", 2: "full", 3: "sparse"}.get(NPROCS, "tiny")]


@pytest.mark.parametrize("algorithm", ALGORITHMS_AND_AUTO)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_allreduce_inside_user_jit(transport, algorithm):
    failures = []
    for config in jit_configs():
        step = user_step(config, transport, algorithm)
        for density, kind in grid(config):
            inp = inputs(config, density, kind)
            label = f"jit {algorithm}/{transport} d={density} {inp}"
            try:
                out, stats, total = step(inp.stream)
                jax.block_until_ready(out)
                failures += check_result(label, algorithm, inp, out, stats, scale=2.0, transport=transport)
                if float(total) != float(np.sum(inp.total * 2, dtype=np.float64)):
                    failures.append(f"{label}: the user's reduction of the result is {float(total)}")
            except Exception as e:  # noqa: BLE001
                failures.append(f"{label}: {type(e).__name__}: {str(e)[:300]}")
                out = None
            failures += check_identical_on_all_ranks(out, label)
        traces = _traces.get((config, transport, algorithm), 0)
        if traces != 1:
            failures.append(f"{config}: the user's step was traced {traces} times for one static signature")
    agree_all(failures, f"jit(sparse_allreduce) {algorithm}/{transport}")


# ----------------------------------------------------------------------------- quantized DSAR


def quantized_bound_failures(label: str, got: np.ndarray, inp: Inputs, quantize_bits: int) -> list[str]:
    """QSGD with the "max" scale rounds each value to one of the two nearest of L levels of its
    bucket's scale s = max |v| (buckets of QUANT_BUCKET values within each rank's range): the error
    of every element is at most s / L. DSAR codes twice. In the split phase rank r's segment for
    range o (r != o) is coded when it travels dense (DSAR runs on the native engine on both MPI
    transports: when its count reaches the dense threshold): error at most s_r / L. The owner then codes its partial sum, whose bucket maximum is at most the exact sum's
    plus that error. Also a 6-sigma bound on the summed error (unbiased)."""
    L = (1 << (quantize_bits - 1)) - 1
    total, n = inp.total, inp.total.size
    split = np.zeros(n)
    gather = np.zeros(n)
    for o in range(NPROCS):
        lo, hi = part_bounds(n, NPROCS, o)
        for r in range(NPROCS):
            if r == o or np.count_nonzero(inp.rows[r, lo:hi]) < dense_threshold(hi - lo):
                continue
            for b in range(lo, hi, QUANT_BUCKET):
                e = min(b + QUANT_BUCKET, hi)
                split[b:e] += np.abs(inp.rows[r, b:e]).max(initial=0.0) / L
        for b in range(lo, hi, QUANT_BUCKET):
            e = min(b + QUANT_BUCKET, hi)
            gather[b:e] = (np.abs(total[b:e]).max(initial=0.0) + split[b:e].max(initial=0.0)) / L
    bound = split + gather
    err = got.astype(np.float64) - total.astype(np.float64)
    failures = []
    if not np.all(np.isfinite(got)):
        failures.append(f"{label}: non-finite values in the result")
    over = np.flatnonzero(np.abs(err) > bound * (1 + 1e-5) + 1e-6)
    if over.size:
        failures.append(f"{label}: {over.size} elements exceed the QSGD bound, e.g. index {over[0]}: "
                        f"err {err[over[0]]} > {bound[over[0]]}")
    sigma = np.sqrt(np.sum((bound / 2) ** 2))  # Var <= s^2 / (4 L^2) per coding
    if abs(err.sum()) > 6 * sigma + 1e-6:
        failures.append(f"{label}: summed error {err.sum()} exceeds 6 sigma = {6 * sigma} (biased?)")
    return failures


@pytest.mark.parametrize("transport,quantize_bits", QUANT_CASES)
def test_quantized_dsar_within_qsgd_bound(transport, quantize_bits):
    failures = []
    cases = [(0.01, "random"), (0.5, "unequal"), (1.0, "random"), (0.0, "random")]
    for step, (density, kind) in enumerate(cases):
        inp = inputs("full", density, kind)
        label = f"q{quantize_bits}/{transport} d={density} {inp}"
        key = jax.random.fold_in(jax.random.key(123), step)
        try:
            out, stats = sparse_allreduce(inp.stream, algorithm="dsar_split_allgather", transport=transport,
                                          quantize_bits=quantize_bits, key=key, bucket_size=QUANT_BUCKET,
                                          return_stats=True)
            got = np.asarray(out.to_dense())
            failures += quantized_bound_failures(label, got, inp, quantize_bits)
            if int(out.nnz) != inp.size or int(stats.algorithm) != ALGORITHMS.index("dsar_split_allgather"):
                failures.append(f"{label}: nnz={int(out.nnz)}, algorithm={int(stats.algorithm)}")
            if density == 0.0 and np.any(got != 0):
                failures.append(f"{label}: zeros did not decode to zeros")
        except Exception as e:  # noqa: BLE001
            failures.append(f"{label}: {type(e).__name__}: {str(e)[:300]}")
            out = None
        failures += check_identical_on_all_ranks(out, label)
    agree_all(failures, f"quantized DSAR {quantize_bits} bits / {transport}")


@pytest.mark.parametrize("transport,quantize_bits", QUANT_CASES)
def test_quantized_dsar_exact_for_constant_inputs(transport, quantize_bits):
    """Every element equal: each bucket's scale is that value, which is a level, so decoding is exact."""
    size = CONFIGS["full"][0]
    failures = []
    for step, c in enumerate((3.0, -2.0)):
        x = jnp.full((size,), np.float32(c))
        s = SparseStream(jnp.arange(size, dtype=jnp.int32), x, jnp.int32(size), size)
        label = f"q{quantize_bits}/{transport} constant {c}"
        try:
            out = sparse_allreduce(s, algorithm="dsar_split_allgather", transport=transport,
                                   quantize_bits=quantize_bits, key=jax.random.key(7 + step), bucket_size=QUANT_BUCKET)
            got = np.asarray(out.to_dense())
            if not np.array_equal(got, np.full(size, np.float32(c * NPROCS))):
                bad = np.flatnonzero(got != c * NPROCS)
                failures.append(f"{label}: {bad.size} elements not exact, e.g. {got[bad[:3]].tolist()}")
        except Exception as e:  # noqa: BLE001
            failures.append(f"{label}: {type(e).__name__}: {str(e)[:300]}")
            out = None
        failures += check_identical_on_all_ranks(out, label)
    agree_all(failures, f"quantized DSAR constant input {quantize_bits} bits / {transport}")


def ramp_inputs() -> Inputs:
    """Every rank a dense ramp of its own slope (CGX's test form): each bucket's values spread
    over its whole scale."""
    inp = Inputs(1001, 1001, 1001, "random", seed=31)
    size = inp.size
    ramp = lambda r: ((np.arange(size) % 97 - 48) * (r + 1) / 8).astype(np.float32)  # noqa: E731
    inp.rows = np.stack([ramp(r) for r in range(NPROCS)])
    inp.total = np.sum(inp.rows, axis=0, dtype=np.float32)
    inp.x = inp.rows[RANK]
    inp.stream = SparseStream(jnp.arange(size, dtype=jnp.int32), jnp.asarray(inp.x), jnp.int32(size), size)
    inp.kind = "ramp"
    return inp


def coding_cases() -> list[Inputs]:
    return [inputs("full", 1.0, "random"), inputs("full", 0.5, "unequal"), inputs("full", 0.01, "random"),
            ramp_inputs()]


def travels_dense(inp: Inputs):
    """Whether rank r's segment for range o travels as a dense slice (so, with QSGD, coded): its
    count reaches the range's dense threshold."""
    def coded(r: int, o: int) -> bool:
        lo, hi = part_bounds(inp.size, NPROCS, o)
        return np.count_nonzero(inp.rows[r, lo:hi]) >= dense_threshold(hi - lo)
    return coded


@pytest.mark.parametrize("transport,quantize_bits", QUANT_CASES)
def test_quantized_dsar_equals_its_reference(transport, quantize_bits):
    """Both phases coded as specified (tests/quantized_dsar_reference.py), bit for bit: a segment
    is coded exactly when it travels as a dense slice (its count reaches the dense threshold), so
    sparse segments stay exact pairs; the owners sum in float32 in rank order."""
    failures = []
    for step, inp in enumerate(coding_cases()):
        label = f"q{quantize_bits}/{transport} {inp}"
        key = jax.random.fold_in(jax.random.key(99), step)
        coded = travels_dense(inp)
        want = quantized_dsar_reference(inp.rows, key, bits=quantize_bits, bucket=QUANT_BUCKET, coded=coded)
        try:
            out = sparse_allreduce(inp.stream, algorithm="dsar_split_allgather", transport=transport,
                                   quantize_bits=quantize_bits, key=key, bucket_size=QUANT_BUCKET)
            got = np.asarray(out.to_dense())
            if not np.array_equal(bits(got), bits(want)):
                bad = np.flatnonzero(bits(got) != bits(want))
                failures.append(f"{label}: {bad.size} elements differ from the reference, e.g. index {bad[0]}: "
                                f"{got[bad[0]]} vs {want[bad[0]]}")
            if inp.kind == "ramp":
                failures += quantized_bound_failures(label, got, inp, quantize_bits)
        except Exception as e:  # noqa: BLE001
            failures.append(f"{label}: {type(e).__name__}: {str(e)[:300]}")
    agree_all(failures, f"quantized DSAR against its reference, {quantize_bits} bits / {transport}")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_quantize_feedback_returns_what_the_split_phase_lost(transport):
    """quantize_feedback: this rank's error is its coded segments minus what their owners
    decoded, bit for bit as specified, zeros where segments went as exact pairs; and the books
    balance: the result plus every rank's error is the exact sum, to the allgather's coding
    (every rank decodes the same bytes there, so that error is shared and left unbiased)."""
    failures = []
    for step, inp in enumerate(coding_cases()):
        label = f"feedback/{transport} {inp}"
        key = jax.random.fold_in(jax.random.key(41), step)
        n = inp.size
        coded = travels_dense(inp)
        try:
            out, error, stats = sparse_allreduce(inp.stream, algorithm="dsar_split_allgather", transport=transport,
                                                 quantize_bits=4, key=key, bucket_size=QUANT_BUCKET,
                                                 quantize_feedback=True, return_stats=True)
            got, error = np.asarray(out.to_dense()), np.asarray(error)
            want = split_phase_error(inp.rows, RANK, key, bits=4, bucket=QUANT_BUCKET, coded=coded)
            if not np.array_equal(bits(error), bits(want)):
                failures.append(f"{label}: {np.count_nonzero(bits(error) != bits(want))} error entries differ from "
                                "the reference")
            if not np.array_equal(bits(got), bits(quantized_dsar_reference(inp.rows, key, bits=4, bucket=QUANT_BUCKET,
                                                                           coded=coded))):
                failures.append(f"{label}: the result changed with quantize_feedback")
            errors = np.stack(COMM.allgather(error)).astype(np.float64)
            books = got + errors.sum(axis=0) - inp.total.astype(np.float64)
            L = 7
            bound = np.zeros(n)
            for o in range(NPROCS):  # the allgather's coding: at most its bucket's scale / L per entry
                lo, hi = part_bounds(n, NPROCS, o)
                for b in range(lo, hi, QUANT_BUCKET):
                    e = min(b + QUANT_BUCKET, hi)
                    bound[b:e] = np.abs(inp.total[b:e] - errors.sum(axis=0)[b:e]).max(initial=0.0) / L
            if np.any(np.abs(books) > bound * (1 + 1e-4) + 1e-4):
                failures.append(f"{label}: result + errors - sum exceeds the allgather's coding bound by "
                                f"{np.max(np.abs(books) - bound)}")

            def kept_dense(r, o, inp=inp):  # nonzeros_allreduce compacts x only below the dense threshold
                return np.count_nonzero(inp.rows[r]) >= dense_threshold(n) or coded(r, o)

            total, error = nonzeros_allreduce(jnp.asarray(inp.x), algorithm="dsar_split_allgather", quantize_bits=4,
                                              key=key, bucket_size=QUANT_BUCKET, transport=transport,
                                              quantize_feedback=True)
            want = quantized_dsar_reference(inp.rows, key, bits=4, bucket=QUANT_BUCKET, coded=kept_dense)
            lost = split_phase_error(inp.rows, RANK, key, bits=4, bucket=QUANT_BUCKET, coded=kept_dense)
            if not (np.array_equal(bits(np.asarray(total)), bits(want))
                    and np.array_equal(bits(np.asarray(error)), bits(lost))):
                failures.append(f"{label}: nonzeros_allreduce's sum or error differs from the reference")
        except Exception as e:  # noqa: BLE001
            failures.append(f"{label}: {type(e).__name__}: {str(e)[:300]}")
    agree_all(failures, f"quantize_feedback / {transport}")


def test_quantize_feedback_with_auto_is_zero_where_nothing_was_coded():
    """auto's run-time choice between exact SSAR and quantized DSAR: the error comes back either
    way, zeros when the chosen algorithm coded nothing."""
    failures = []
    for density in (1e-3, 1.0):
        inp = inputs("full", density, "random")
        label = f"auto feedback d={density}"
        try:
            out, error, stats = sparse_allreduce(inp.stream, algorithm="auto", quantize_bits=4, key=jax.random.key(2),
                                                 bucket_size=QUANT_BUCKET, quantize_feedback=True, return_stats=True)
            chosen = ALGORITHMS[int(stats.algorithm)]
            if chosen != "dsar_split_allgather" and (np.any(np.asarray(error) != 0)
                                                     or not np.array_equal(bits(np.asarray(out.to_dense())),
                                                                           bits(inp.total))):
                failures.append(f"{label}: {chosen} must be exact with a zero error")
            if chosen == "dsar_split_allgather" and NPROCS > 1 and not np.any(np.asarray(error) != 0):
                failures.append(f"{label}: quantized DSAR on dense data lost nothing?")
        except Exception as e:  # noqa: BLE001
            failures.append(f"{label}: {type(e).__name__}: {str(e)[:300]}")
    agree_all(failures, "quantize_feedback with auto")


def bf16(x: np.ndarray) -> np.ndarray:
    """float32 values as a bfloat16 wire delivers them (rounded to nearest even)."""
    return np.asarray(jnp.asarray(x, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32))


@pytest.mark.parametrize("transport", ["native", "mpi4jax"])
@pytest.mark.parametrize("algorithm", ALGORITHMS_AND_AUTO)
def test_bfloat16_wire_on_fractional_values(algorithm, transport):
    """value_dtype=bfloat16 on values bfloat16 cannot hold: every rank ends with the same sum, within
    bfloat16's rounding of every partial sum it sent; DSAR and the dense allreduce (which runs as
    DSAR's phases) are bit for bit their reference: the owner adds the rounded segments of the
    others to its own in rank order in float32, and its slice travels rounded."""
    failures = []
    for density in (1.0, 0.5, 0.01):
        inp = inputs("full", density, "random")
        rows = inp.rows * np.float32(1.0 / 3.0) + np.where(inp.rows != 0, np.float32(1e-3), np.float32(0))
        x = rows[RANK]
        label = f"bf16 {algorithm}/{transport} d={density}"
        try:
            stream = from_dense(jnp.asarray(x), capacity=inp.size)
            out, stats = sparse_allreduce(stream, algorithm=algorithm, transport=transport, value_dtype=jnp.bfloat16,
                                          return_stats=True)
            wide = sparse_allreduce(stream, algorithm=algorithm, transport=transport, return_stats=True)[1]
            if NPROCS > 1 and algorithm != "auto" and not float(stats.bytes_sent) < float(wide.bytes_sent):
                failures.append(f"{label}: sent {float(stats.bytes_sent)} bytes, float32 {float(wide.bytes_sent)}")
            got = np.asarray(out.to_dense())
            total = rows.astype(np.float64).sum(axis=0)
            rounds = int(np.ceil(np.log2(max(NPROCS, 2)))) + NPROCS  # a partial sum rounded per message at most
            bound = np.abs(rows).astype(np.float64).sum(axis=0) * rounds * 2.0 ** -8
            if np.any(np.abs(got - total) > bound + 1e-6):
                failures.append(f"{label}: error {np.max(np.abs(got - total))} beyond bfloat16's rounding")
            if algorithm in ("dense", "dsar_split_allgather"):
                want = np.zeros(inp.size, np.float32)
                for o in range(NPROCS):
                    lo, hi = part_bounds(inp.size, NPROCS, o)
                    owned = np.zeros(hi - lo, np.float32)
                    for r in range(NPROCS):
                        owned = owned + (rows[r, lo:hi] if r == o else bf16(rows[r, lo:hi]))
                    want[lo:hi] = bf16(owned)
                if not np.array_equal(bits(got), bits(want)):
                    failures.append(f"{label}: {np.count_nonzero(bits(got) != bits(want))} entries differ from the "
                                    "bfloat16 reference")
        except Exception as e:  # noqa: BLE001
            failures.append(f"{label}: {type(e).__name__}: {str(e)[:300]}")
            out = None
        failures += check_identical_on_all_ranks(out, label)
    agree_all(failures, f"bfloat16 wire {algorithm}/{transport}")


def test_quantized_dsar_on_static_buffers_equals_its_reference():
    """The mpi4jax transport interprets quantized DSAR too (sparse_allreduce runs DSAR on the
    native engine on both MPI transports): a stream of capacity N codes every segment."""
    from sparcml_jax.collectives._plan import Quantization, definition
    from sparcml_jax.comm.mpi4jax_transport import Mpi4jaxTransport

    inp = ramp_inputs()
    key = jax.random.key(8)

    @jax.jit
    def run(stream, key):
        t = Mpi4jaxTransport(COMM, 1.0, stream.size, jnp.int32(0), key)
        return definition("dsar_split_allgather")(t, stream, quantize=Quantization(4, QUANT_BUCKET)).to_dense()

    got = np.asarray(run(inp.stream, key))
    want = quantized_dsar_reference(inp.rows, key, bits=4, bucket=QUANT_BUCKET)
    failures = [] if np.array_equal(bits(got), bits(want)) else [
        f"{np.count_nonzero(bits(got) != bits(want))} elements differ from the reference"]
    agree_all(failures, "quantized DSAR on the mpi4jax transport")


def test_quantized_dsar_is_unbiased():
    """QSGD's rounding is unbiased in both phases: over many keys the mean result approaches the
    exact sum, within 5 standard errors of the mean per element's summed error."""
    inp = inputs("full", 1.0, "random")
    samples = 48
    results = np.stack([np.asarray(sparse_allreduce(inp.stream, algorithm="dsar_split_allgather", quantize_bits=2,
                                                    key=jax.random.fold_in(jax.random.key(5), i),
                                                    bucket_size=QUANT_BUCKET).to_dense(), np.float64)
                        for i in range(samples)])
    err = results - inp.total.astype(np.float64)
    per_bucket_error = [err[:, b:b + QUANT_BUCKET].sum(axis=1) for b in range(0, inp.size, QUANT_BUCKET)]
    failures = []
    for b, e in enumerate(per_bucket_error):
        if abs(e.mean()) > 5 * e.std(ddof=1) / np.sqrt(samples) + 1e-6:
            failures.append(f"bucket {b}: mean summed error {e.mean()} over {samples} keys, "
                            f"standard error {e.std(ddof=1) / np.sqrt(samples)} (biased?)")
    agree_all(failures, "quantized DSAR unbiased")


def test_quantized_auto_is_exact_unless_dsar():
    """With quantize_bits, "auto" quantizes only when it picks DSAR; any SSAR choice stays exact."""
    failures = []
    for density, kind in [(1e-3, "random"), (1.0, "random")]:
        inp = inputs("full", density, kind)
        label = f"auto q4 d={density} {inp}"
        try:
            out, stats = sparse_allreduce(inp.stream, algorithm="auto", quantize_bits=4, key=jax.random.key(3),
                                          bucket_size=QUANT_BUCKET, return_stats=True)
            got = np.asarray(out.to_dense())
            if ALGORITHMS[int(stats.algorithm)] == "dsar_split_allgather":
                failures += quantized_bound_failures(label, got, inp, 4)
            elif not np.array_equal(bits(got), bits(inp.total)):
                failures.append(f"{label}: {ALGORITHMS[int(stats.algorithm)]} result is not the exact sum")
        except Exception as e:  # noqa: BLE001
            failures.append(f"{label}: {type(e).__name__}: {str(e)[:300]}")
            out = None
        failures += check_identical_on_all_ranks(out, label)
    agree_all(failures, "auto with quantize_bits")


# ----------------------------------------------------------------------------- sparse_allgather


ALLGATHER_CASES = {  # name: (N, capacity, [(k, kind), ...])
    "sparse": (1000, 24, [(0, "disjoint"), (5, "disjoint"), (24, "disjoint"), (20, "unequal")]),
    "dense": (1001, 1001, [(1, "disjoint"), (60, "disjoint"), (1001 // max(NPROCS, 2) + 1, "disjoint"),
                           (1001, "disjoint"), (100, "unequal")]),
}


ALLGATHER_RUNS = ([(c, t) for c in ALLGATHER_CASES for t in TRANSPORTS] if NPROCS <= 4
                  else [("sparse", "mpi4jax"), ("dense", "native")])  # compiles are slow at P = 5, 8


@pytest.mark.parametrize("case,transport", ALLGATHER_RUNS)
def test_allgather_concatenates_disjoint_supports(case, transport):
    size, capacity, ks = ALLGATHER_CASES[case]
    failures = []
    for i, (k, kind) in enumerate(ks):
        inp = Inputs(size, capacity, min(k, capacity), kind, seed=5000 + i)
        label = f"allgather/{transport} {inp}"
        try:
            out, stats = sparse_allgather(inp.stream, transport=transport, return_stats=True)
            got = np.asarray(out.to_dense())
            if not np.array_equal(bits(got), bits(inp.total)):
                failures.append(f"{label}: union differs at {np.count_nonzero(got != inp.total)} indices")
            failures += check_well_formed(out, label)
            union = inp.union.size
            want = size if out.capacity >= size and union >= dense_threshold(size) else union
            if NPROCS == 1:  # no merge at all: the input passes through
                want = union
            if int(out.nnz) != want:
                failures.append(f"{label}: nnz={int(out.nnz)}, expected {want} (union {union})")
            if kind == "disjoint":  # every rank's pairs, each exactly once
                mine = inp.x[inp.support]
                if not np.array_equal(got[inp.support], mine):
                    failures.append(f"{label}: this rank's own pairs were not kept as they are")
            if int(stats.result_nnz) != int(out.nnz) or float(stats.bytes_sent) < 0:
                failures.append(f"{label}: stats {stats}")
        except Exception as e:  # noqa: BLE001
            failures.append(f"{label}: {type(e).__name__}: {str(e)[:300]}")
            out = None
        failures += check_identical_on_all_ranks(out, label)
    agree_all(failures, f"sparse_allgather {case}/{transport}")


def test_rank_count_and_input_sanity():
    """The oracle itself: unequal supports really are unequal, identical ones identical."""
    def body():
        out = []
        inp = inputs("full", 0.1, "unequal")
        if NPROCS > 1 and len({s.size for s in inp.supports}) == 1:
            out.append("'unequal' supports all have the same nnz")
        same = inputs("full", 0.1, "identical")
        if any(not np.array_equal(s, same.supports[0]) for s in same.supports):
            out.append("'identical' supports differ")
        if RANK == 0 and inputs("full", 1.0, "random").stream.nnz != 1001:
            out.append("density 1.0 did not produce a dense stream")
        return out

    run_and_agree(body, "input sanity")


@pytest.mark.skipif(NPROCS < 2, reason="one rank has nothing to choose")
def test_auto_on_mpi4jax_prices_the_capacity_and_chooses_at_trace_time():
    """The mpi4jax transport moves whole static buffers, so a stream of capacity N costs a dense
    vector per message however few nonzeros it holds: auto must not run recursive doubling on it
    (measured 8x the dense allreduce at N = 2^22, P = 4), and since its prices then depend on
    capacities alone it chooses while tracing, without the run-time switch the native transport
    needs: there the table holds the best algorithm at every bound of the actual count."""
    model = CostModel(alpha=1e-5, beta=1e-9, dense_alpha=1e-5, dense_beta=2.5e-10, pair_cost=5e-9,
                      element_cost=2.5e-10)
    inp = inputs("full", 1e-3, "random")
    failures = []
    out, stats = sparse_allreduce(inp.stream, transport="mpi4jax", cost_model=model, return_stats=True)
    if ALGORITHMS[int(stats.algorithm)] != "dense":
        failures.append(f"mpi4jax chose {ALGORITHMS[int(stats.algorithm)]} for a capacity-N stream")
    if not np.array_equal(np.asarray(out.to_dense()), inp.total):
        failures.append("wrong sum")
    rows = choice_table(model, Plan(COMM, "mpi4jax", 1.0), inp.size, inp.capacity)
    if rows != [(inp.capacity, "dense")]:
        failures.append(f"mpi4jax: choice table {rows}, expected dense, chosen while tracing")
    native = Plan(COMM, "native", 1.0)
    rows = choice_table(model, native, inp.size, inp.capacity)
    for bound, name in rows:  # the native transport prices the actual count
        if name != best(model, native, inp.size, inp.capacity, bound):
            failures.append(f"native: choice table {rows} does not hold the best algorithm at nnz={bound}")
    agree_all(failures, "auto on the mpi4jax transport")
