"""Single process (no mpirun): one token chain for every MPI op, and P = 1 identities.

XLA:CPU runs independent custom calls out of order; only a token threaded through every MPI op
orders them, and our ops must join mpi4jax's ordered effect (two chains deadlock when mixed, see
design.md). In the lowered StableHLO a function on one chain takes one token argument and returns
one token result: ``jax.token = true`` appears twice in its signature (four times for two chains).
The collectives are jitted functions of their own, so each becomes a private function that must
also carry exactly that one chain.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import mpi4jax
import numpy as np
import pytest
from mpi4py import MPI

from sparcml_jax import (
    ALGORITHMS,
    SparseStream,
    dense_allreduce,
    dense_threshold,
    sparse_allgather,
    sparse_allreduce,
    sparse_allreduce_start,
    sparse_allreduce_wait,
)

ERRORS = (ValueError, RuntimeError)
TRANSPORTS = ("native", "mpi4jax")
ALGORITHMS_AND_AUTO = (*ALGORITHMS, "auto")

pytestmark = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1, reason="single-process tests")


def stream(size: int, support, values=None, capacity: int | None = None) -> SparseStream:
    support = np.asarray(sorted(support), np.int32)
    values = np.arange(1, support.size + 1, dtype=np.float32) if values is None else np.asarray(values, np.float32)
    capacity = max(support.size, 1) if capacity is None else capacity
    if support.size == size:
        support = np.arange(size, dtype=np.int32)
    pad = capacity - support.size
    return SparseStream(jnp.asarray(np.concatenate([support, np.full(pad, size, np.int32)])),
                        jnp.asarray(np.concatenate([values, np.zeros(pad, np.float32)])),
                        jnp.int32(support.size), size)


def signatures(text: str) -> dict[str, int]:
    """Number of ``jax.token = true`` in the signature of every function of the module."""
    out = {}
    for line in text.splitlines():
        m = re.match(r"\s*func\.func (?:public |private )?@([\w.$-]+)\(", line)
        if m:
            out[m.group(1)] = line.count("jax.token = true")
    return out


def mixed(s: SparseStream, x: jax.Array):
    """Both transports, the non-blocking engine and a plain mpi4jax op in one program."""
    handle = sparse_allreduce_start(s, algorithm="ssar_split_allgather")
    a = sparse_allreduce(s, algorithm="ssar_recursive_doubling", transport="native")
    b = sparse_allreduce(s, algorithm="ssar_recursive_doubling", transport="mpi4jax")  # mpi4jax ops inside
    c = sparse_allreduce(s, algorithm="ssar_split_allgather", transport="native")
    d = mpi4jax.allreduce(x, op=MPI.SUM)
    e = sparse_allgather(s, transport="mpi4jax")
    f = sparse_allreduce_wait(handle, after=d)
    return a.to_dense() + b.to_dense() + c.to_dense() + d + e.to_dense() + f.to_dense()


def test_mixed_program_has_exactly_one_token_chain():
    s, x = stream(64, [3, 9, 40], capacity=8), jnp.ones(64)
    text = jax.jit(mixed).lower(s, x).as_text()
    targets = re.findall(r"custom_call @(\w+)", text)
    # All three kinds of MPI op are in the program (otherwise the count below proves nothing).
    assert "sparcml_mpi_run" in targets, targets
    assert "mpi_allreduce_ffi" in targets, targets
    assert "sparcml_engine_start" in targets and "sparcml_engine_wait" in targets, targets
    sig = signatures(text)
    assert sig["main"] == 2, f"main carries {sig['main']} token markers (2 = one chain, 4 = two chains)"
    assert all(n in (0, 2) for n in sig.values()), sig
    # The nested collectives are the only other functions with tokens: each on the same (single) chain.
    assert sum(n == 2 for n in sig.values()) >= 2, sig


def test_whole_text_count_for_a_flat_program():
    """Without nested collectives (a plain mpi4jax op) the whole text has the two markers of main."""
    text = jax.jit(lambda x: mpi4jax.allreduce(x, op=MPI.SUM) * 2).lower(jnp.ones(4)).as_text()
    assert text.count("jax.token = true") == 2


def test_token_counting_detects_a_second_chain():
    """Control: an op on another ordered effect (ordered debug print) adds a second chain to main."""
    s, x = stream(64, [3, 9], capacity=4), jnp.ones(64)

    def two_chains(s, x):
        jax.debug.print("{}", x[0], ordered=True)
        return sparse_allreduce(s, algorithm="ssar_recursive_doubling").to_dense() + mpi4jax.allreduce(x, op=MPI.SUM)

    assert signatures(jax.jit(two_chains).lower(s, x).as_text())["main"] == 4


def test_mixed_program_runs_and_is_the_identity_sum():
    s, x = stream(64, [3, 9, 40], capacity=8), jnp.arange(64, dtype=jnp.float32)
    got = np.asarray(jax.jit(mixed)(s, x))
    want = 5 * np.asarray(s.to_dense()) + np.asarray(x)
    np.testing.assert_array_equal(got, want)


# ----------------------------------------------------------------------------- P = 1 identities


CASES = {  # name: (size, support, capacity)
    "empty": (100, [], 8),
    "one": (100, [99], 8),
    "sparse": (100, [0, 5, 17, 63], 8),
    "half (sparse pairs at the threshold)": (100, list(range(0, 100, 2)), 100),
    "dense": (100, list(range(100)), 100),
    "tiny": (3, [1], 3),
    "size one": (1, [0], 1),
}


@pytest.mark.parametrize("algorithm", ALGORITHMS_AND_AUTO)
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("case", list(CASES))
def test_single_process_allreduce_is_the_identity(case, transport, algorithm):
    size, support, capacity = CASES[case]
    s = stream(size, support, capacity=capacity)
    out, stats = sparse_allreduce(s, algorithm=algorithm, transport=transport, return_stats=True)
    np.testing.assert_array_equal(np.asarray(out.to_dense()), np.asarray(s.to_dense()))
    chosen = ALGORITHMS[int(stats.algorithm)]
    if algorithm != "auto":
        assert chosen == algorithm
    nnz, k = int(out.nnz), len(support)
    if chosen in ("dense", "dsar_split_allgather"):
        assert nnz == size
    elif chosen == "ssar_recursive_doubling":
        assert nnz == k  # nothing to merge: the stream passes through
    else:  # the split phase merges this rank's only segment and decides on its count
        assert nnz == (size if out.capacity >= size and k >= dense_threshold(size) else k)
    assert int(stats.result_nnz) == nnz
    assert float(stats.bytes_sent) == 0.0  # nothing leaves a single process
    valid = np.asarray(out.indices)[:nnz]
    assert np.all(np.diff(valid) > 0) and np.all(np.asarray(out.indices)[nnz:] == size)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_single_process_allreduce_inside_jit(transport):
    @jax.jit
    def step(s):
        doubled = SparseStream(s.indices, 2 * s.values, s.nnz, s.size)
        outs = [sparse_allreduce(doubled, algorithm=a, transport=transport).to_dense() for a in ALGORITHMS_AND_AUTO]
        return jnp.stack(outs)

    for support in ([], [4], [1, 2, 3, 50, 99]):
        s = stream(100, support, capacity=8)
        got = np.asarray(step(s))
        np.testing.assert_array_equal(got, np.broadcast_to(2 * np.asarray(s.to_dense()), got.shape))


@pytest.mark.parametrize("quantize_bits", (2, 4, 8))
def test_single_process_quantized_dsar(quantize_bits):
    rng = np.random.default_rng(quantize_bits)
    x = rng.integers(-20, 21, 300).astype(np.float32)
    s = SparseStream(jnp.arange(300, dtype=jnp.int32), jnp.asarray(x), jnp.int32(300), 300)
    out = sparse_allreduce(s, algorithm="dsar_split_allgather", quantize_bits=quantize_bits, key=jax.random.key(1),
                           bucket_size=64)
    L = (1 << (quantize_bits - 1)) - 1
    scale = np.repeat([np.abs(x[b:b + 64]).max() for b in range(0, 300, 64)], 64)[:300]
    err = np.abs(np.asarray(out.to_dense()) - x)
    assert np.all(err <= scale / L * (1 + 1e-6)), (err / scale).max()
    const = jnp.full((300,), np.float32(-7.0))
    c = SparseStream(jnp.arange(300, dtype=jnp.int32), const, jnp.int32(300), 300)
    exact = sparse_allreduce(c, algorithm="dsar_split_allgather", quantize_bits=quantize_bits, key=jax.random.key(2),
                             bucket_size=64)
    np.testing.assert_array_equal(np.asarray(exact.to_dense()), np.full(300, -7.0, np.float32))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_single_process_allgather_and_dense_allreduce(transport):
    s = stream(100, [2, 30, 31], capacity=4)
    out, stats = sparse_allgather(s, transport=transport, return_stats=True)
    np.testing.assert_array_equal(np.asarray(out.to_dense()), np.asarray(s.to_dense()))
    assert int(out.nnz) == 3 and int(stats.result_nnz) == 3 and float(stats.bytes_sent) == 0.0
    np.testing.assert_array_equal(np.asarray(dense_allreduce(jnp.arange(5.0))), np.arange(5.0))


def test_single_process_bad_stream_raises():
    bad = SparseStream(jnp.asarray([5, 3, 100, 100], jnp.int32), jnp.ones(4), jnp.int32(2), 100)
    with pytest.raises(ERRORS, match="strictly increasing"):
        jax.block_until_ready(sparse_allreduce(bad, algorithm="ssar_recursive_doubling"))
    with pytest.raises(ValueError, match="quantize_bits must be one of"):
        sparse_allreduce(stream(100, [1], capacity=4), algorithm="dsar_split_allgather", quantize_bits=3,
                         key=jax.random.key(0))
    with pytest.raises(ValueError, match="quantize_feedback returns the error of QSGD's split phase: it needs "
                                         "quantize_bits"):
        sparse_allreduce(stream(100, [1], capacity=4), algorithm="dsar_split_allgather", quantize_feedback=True)
    with pytest.raises(ValueError, match="value_dtype must be jnp.float32 or jnp.bfloat16"):
        sparse_allreduce(stream(100, [1], capacity=4), value_dtype=jnp.float16)
    good = stream(100, [1, 2], capacity=4)
    np.testing.assert_array_equal(np.asarray(sparse_allreduce(good, algorithm="ssar_recursive_doubling").to_dense()),
                                  np.asarray(good.to_dense()))


def test_exchange_with_a_peer_outside_the_communicator_raises():
    from sparcml_jax.comm.mpi4jax_transport import Mpi4jaxTransport
    from sparcml_jax.comm.native import Recorder

    s = stream(100, [1, 2], capacity=4)
    for t in (Recorder(0, 1, 1.0, 100), Mpi4jaxTransport(MPI.COMM_WORLD, 1.0, 100, agreed=jnp.int32(0))):
        with pytest.raises(ValueError, match=r"must name ranks in \[0, 1\), each at most once"):
            t.exchange(s, [(0, 1)], combine="add")
        with pytest.raises(ValueError, match=r"must name ranks in \[0, 1\)"):
            t.exchange(s, [(-2, 0)], combine="add")


def test_one_program_per_call_on_the_native_transport():
    """A blocking native collective is one FFI call: no agreement step before it, no status
    check after it (they ride on the algorithm's own messages)."""
    s = stream(64, [3, 9, 40], capacity=8)
    for algorithm in ALGORITHMS:
        text = jax.jit(lambda s: sparse_allreduce(s, algorithm=algorithm).values).lower(s).as_text()
        assert re.findall(r"custom_call @(sparcml_mpi\w+)", text) == ["sparcml_mpi_run"], algorithm
