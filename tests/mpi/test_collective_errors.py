"""Bad input on one or several ranks: every rank raises a clear error, nobody hangs, and the
next collective still works (run under mpirun -n P; the spawner's timeout turns a hang into a
failure).

Ranks that disagree on a static choice are caught by the signature check inside the first MPI
call of every collective (tests/test_mpi_spawn.py also covers ranks that diverge before it). Bad
streams are caught by the validation that precedes any exchange, so they reuse the good programs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _util import (
    ALGORITHMS_AND_AUTO,
    NPROCS,
    RANK,
    TRANSPORTS,
    Inputs,
    agree_all,
    agree_on_poisoned_tokens,
    expect_error_everywhere,
    make_stream,
    run_and_agree,
)

import sparcml_jax
from sparcml_jax import SparseStream, sparse_allgather, sparse_allreduce

SIZE, CAPACITY = 1000, 24  # the "sparse" configuration of test_collectives: programs are shared
BAD_RANK = NPROCS - 1
# How an error reaches every rank does not depend on P beyond what P = 1, 2 and 3 cover (one rank,
# a pair, a non-power of two whose extra rank folds in); at P = 5 these checks' compiles took half a
# minute of the 2-core CI, at P = 8 a minute.
pytestmark = pytest.mark.skipif(NPROCS > 3, reason="the error checks run at P <= 3")
needs_two_ranks = pytest.mark.skipif(NPROCS < 2, reason="a disagreement needs two ranks")


def good_inputs() -> Inputs:
    return Inputs(SIZE, CAPACITY, 10, "random", seed=31337)


def assert_next_collective_works(algorithm: str = "ssar_recursive_doubling", transport: str = "native") -> None:
    """After an error every rank can still run a correct collective on the same communicator."""
    inp = good_inputs()

    def body():
        out = sparse_allreduce(inp.stream, algorithm=algorithm, transport=transport)
        got = np.asarray(out.to_dense())
        return [] if np.array_equal(got, inp.total) else [f"{algorithm}/{transport} after an error: wrong sum"]

    run_and_agree(body, f"good allreduce after an error ({algorithm}/{transport})")


def assert_recovered(algorithm: str = "ssar_recursive_doubling", transport: str = "native") -> None:
    """No rank is left with a failed ordered-effect token, and the next collective works."""
    agree_all(agree_on_poisoned_tokens(), "no stale error left in JAX's runtime token")
    assert_next_collective_works(algorithm, transport)


def stream_of_size(size: int, capacity: int) -> SparseStream:
    idx = np.array([RANK % size], np.int32) if capacity else np.zeros(0, np.int32)
    return make_stream(idx, np.ones(idx.size, np.float32), size, capacity)


# ----------------------------------------------------------------------------- disagreements


@needs_two_ranks
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_ranks_disagree_on_size(transport):
    size = {"native": 501, "mpi4jax": 511}[transport] + (RANK == 0)
    expect_error_everywhere(
        lambda: sparse_allreduce(stream_of_size(size, 4), algorithm="ssar_recursive_doubling", transport=transport),
        "ranks disagree on size", "different N")
    assert_next_collective_works(transport=transport)


@needs_two_ranks
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_ranks_disagree_on_capacity(transport):
    size = {"native": 503, "mpi4jax": 513}[transport]
    expect_error_everywhere(
        lambda: sparse_allreduce(stream_of_size(size, 5 if RANK == 0 else 6), algorithm="ssar_split_allgather",
                                 transport=transport),
        "ranks disagree on capacity", "different capacities")
    assert_next_collective_works("ssar_split_allgather", transport)


@needs_two_ranks
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_nonzeros_allreduce_of_a_bad_vector_on_one_rank(transport):
    """A vector of the wrong dtype on rank 0: it raises naming x there, and its peers raise too."""
    x = jnp.ones(507, jnp.int32 if RANK == 0 else jnp.float32)
    expect_error_everywhere(lambda: sparcml_jax.nonzeros_allreduce(x, transport=transport),
                            lambda r: "x must have dtype float32" if r == 0 else "rejected its arguments",
                            "nonzeros_allreduce of an int32 vector on rank 0")
    assert_next_collective_works(transport=transport)


@needs_two_ranks
def test_ranks_disagree_on_algorithm():
    algorithm = "ssar_recursive_doubling" if RANK == 0 else "dsar_split_allgather"
    expect_error_everywhere(lambda: sparse_allreduce(stream_of_size(505, 4), algorithm=algorithm),
                            "ranks disagree on algorithm", "different algorithms")
    assert_next_collective_works()


@needs_two_ranks
@pytest.mark.parametrize("shift", range(len(sparcml_jax.ALGORITHMS)))
def test_ranks_running_different_schedules_all_raise(shift):
    """Every rank runs another algorithm's schedule (rank r the algorithm r + shift, in turn), the
    native and the mpi4jax transport mixed: no rank can finish, every rank must raise, and the
    abort leaves no message behind for the next collective."""
    names = sparcml_jax.ALGORITHMS
    algorithm = names[(RANK + shift) % len(names)]
    transport = TRANSPORTS[(RANK // len(names)) % 2] if shift % 2 else "native"
    expect_error_everywhere(
        lambda: sparse_allreduce(stream_of_size(601 + shift, 8), algorithm=algorithm, transport=transport),
        "ranks disagree on", f"rank r runs {names[shift]} + r")
    assert_recovered()
    assert_next_collective_works("ssar_split_allgather")


@needs_two_ranks
def test_ranks_disagree_on_transport():
    transport = "native" if RANK == 0 else "mpi4jax"
    expect_error_everywhere(
        lambda: sparse_allreduce(stream_of_size(507, 4), algorithm="ssar_recursive_doubling", transport=transport),
        "ranks disagree on transport", "different transports")
    assert_next_collective_works()


@needs_two_ranks
def test_ranks_disagree_on_quantize_bits():
    bits = 2 if RANK == 0 else 4
    expect_error_everywhere(
        lambda: sparse_allreduce(stream_of_size(509, 4), algorithm="dsar_split_allgather", quantize_bits=bits,
                                 key=jax.random.key(0)),
        "ranks disagree on quantize_bits", "different quantize_bits")
    assert_next_collective_works("dsar_split_allgather")


@needs_two_ranks
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_allgather_ranks_disagree_on_size(transport):
    size = {"native": 521, "mpi4jax": 531}[transport] + (RANK == 0)
    expect_error_everywhere(lambda: sparse_allgather(stream_of_size(size, 4), transport=transport),
                            "ranks disagree on size", "sparse_allgather with different N")
    assert_next_collective_works(transport=transport)


# ----------------------------------------------------------------------------- a bad stream on one rank


def bad_stream(kind: str) -> SparseStream:
    """The good stream on every rank but BAD_RANK, which gets a broken one of the same shape."""
    inp = good_inputs()
    if RANK != BAD_RANK:
        return inp.stream
    idx = np.asarray(inp.stream.indices).copy()
    val = np.asarray(inp.stream.values)
    nnz = int(inp.stream.nnz)
    if kind == "unsorted":
        idx[[0, 1]] = idx[[1, 0]]
    elif kind == "duplicate":
        idx[1] = idx[0]
    elif kind == "out_of_range":
        idx[nnz - 1] = SIZE
    elif kind == "negative_index":
        idx[0] = -3
    elif kind == "nnz_over_capacity":
        nnz = CAPACITY + 1
    elif kind == "negative_nnz":
        nnz = -1
    return SparseStream(jnp.asarray(idx), jnp.asarray(val), jnp.asarray(nnz, jnp.int32), SIZE)


BAD_KINDS = {  # kind: text of the error on the bad rank
    "unsorted": "strictly increasing",
    "duplicate": "strictly increasing",
    "out_of_range": "must lie in [0, n=1000)",
    "negative_index": "must lie in [0, n=1000)",
    "nnz_over_capacity": "nnz=25 exceeds its capacity 24",
    "negative_nnz": "nnz=-1 is negative",
}


def expected_message(kind: str):
    """The bad rank names the problem; the others say another rank's input is invalid."""
    return lambda rank: BAD_KINDS[kind] if rank == BAD_RANK else "another rank"


@pytest.mark.parametrize("algorithm", ALGORITHMS_AND_AUTO)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_bad_stream_on_one_rank_raises_everywhere(transport, algorithm):
    for kind in BAD_KINDS:
        expect_error_everywhere(
            lambda: sparse_allreduce(bad_stream(kind), algorithm=algorithm, transport=transport),
            expected_message(kind), f"{kind} stream on rank {BAD_RANK} ({algorithm}/{transport})")
        assert_recovered(algorithm, transport)  # the eager call resets JAX's token itself


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_stream_without_indices_and_a_wrong_count_on_one_rank(transport):
    """A stream without an index array must hold its size's count: a known count is rejected
    while tracing, a traced one by the engine, on every rank."""
    def stream():
        nnz = SIZE if RANK != BAD_RANK else 7
        return SparseStream(jnp.zeros((0,), jnp.int32), jnp.ones(SIZE), jnp.asarray(nnz, jnp.int32), SIZE)

    def message(rank):
        return "a stream without indices is dense" if rank == BAD_RANK else "another rank"

    step = jax.jit(lambda s: sparse_allreduce(s, algorithm="dense", transport=transport).to_dense())
    expect_error_everywhere(lambda: sparse_allreduce(stream(), algorithm="dense", transport=transport), message,
                            f"a dense stream with nnz=7 on rank {BAD_RANK} ({transport})")
    assert_recovered("dense", transport)
    expect_error_everywhere(lambda: step(stream()), message, f"jit: a dense stream with nnz=7 ({transport})")
    sparcml_jax.reset_after_error()
    assert_recovered("dense", transport)


def test_bad_stream_on_one_rank_inside_user_jit():
    @jax.jit
    def step(s):
        return sparse_allreduce(s, algorithm="ssar_split_allgather").to_dense()

    good = good_inputs()
    for kind in ("unsorted", "nnz_over_capacity"):
        expect_error_everywhere(lambda: step(bad_stream(kind)), expected_message(kind), f"jit: {kind}")
        sparcml_jax.reset_after_error()  # inside a user's jit the user recovers, as documented
        assert_recovered("ssar_split_allgather")
        run_and_agree(lambda: [] if np.array_equal(np.asarray(step(good.stream)), good.total) else ["wrong sum"],
                      "the same jitted step with a good stream")


BUILT_IN_THE_STEP = {  # how the bad rank's stream goes wrong inside the step: its error there
    "from_dense over capacity": "nnz=12 exceeds its capacity 8",
    "coalesce over capacity": "nnz=12 exceeds its capacity 8",
    "coalesce out of range": f"found {SIZE + 1} (coalesce keeps the first index outside",
    "merge over capacity": "nnz=12 exceeds its capacity 8",
}


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("case", list(BUILT_IN_THE_STEP))
def test_stream_built_badly_in_the_step_raises_everywhere(case, transport):
    """from_dense, coalesce and merge run on each rank before the collective, so they must not
    raise there: the bad rank would stop while its peers wait in the collective. Their invalid
    stream reaches the collective's validation instead, in the same jitted program."""
    @jax.jit
    def step(x, idx, val):
        if case.startswith("from_dense"):
            s = sparcml_jax.from_dense(x, capacity=8)
        elif case.startswith("merge"):
            half = idx.size // 2
            s = sparcml_jax.merge(sparcml_jax.coalesce(idx[:half], val[:half], size=SIZE, capacity=8),
                                  sparcml_jax.coalesce(idx[half:], val[half:], size=SIZE, capacity=8), capacity=8)
        else:
            s = sparcml_jax.coalesce(idx, val, size=SIZE, capacity=8)
        return sparse_allreduce(s, algorithm="ssar_recursive_doubling", transport=transport).to_dense()

    count = 12 if RANK == BAD_RANK else 5
    idx = (np.arange(count, dtype=np.int32) * 7 + RANK) % SIZE
    if case == "coalesce out of range" and RANK == BAD_RANK:
        idx[3] = SIZE + 1
    val = np.ones(count, np.float32)
    x = np.zeros(SIZE, np.float32)
    x[idx % SIZE] = 1.0
    want = BUILT_IN_THE_STEP[case] if RANK == BAD_RANK else "another rank"
    expect_error_everywhere(lambda: step(x, idx, val), want, f"{case} ({transport})")
    sparcml_jax.reset_after_error()
    assert_recovered(transport=transport)


def test_reset_after_error_recovers_from_an_async_failure():
    """A user's step with a loop (XLA:CPU runs it asynchronously) around an allreduce that gets a
    bad stream on one rank: every rank raises, JAX keeps the error in its ordered-effect token
    (every later MPI program would re-raise it), and reset_after_error() clears it on every rank."""
    @jax.jit
    def step(s, x):
        x = jax.lax.fori_loop(0, 50, lambda i, x: jnp.sin(x) + 1, x)
        return sparse_allreduce(s, algorithm="ssar_recursive_doubling").to_dense().sum() + x.sum()

    x = jnp.ones(256)
    good = good_inputs()
    run_and_agree(lambda: (step(good.stream, x).block_until_ready(), [])[1], "warm-up")
    expect_error_everywhere(lambda: step(bad_stream("unsorted"), x), expected_message("unsorted"), "async step")
    sparcml_jax.reset_after_error()
    assert_recovered()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_bad_stream_in_allgather_raises_everywhere(transport):
    good = good_inputs()
    for kind in ("unsorted", "out_of_range", "nnz_over_capacity"):
        expect_error_everywhere(lambda: sparse_allgather(bad_stream(kind), transport=transport),
                                expected_message(kind), f"sparse_allgather {kind} ({transport})")
        agree_all(agree_on_poisoned_tokens(), "no stale error left in JAX's runtime token")
        run_and_agree(lambda: [] if np.array_equal(np.asarray(sparse_allgather(good.stream, transport=transport)
                                                              .to_dense()), good.total) else ["wrong union"],
                      "sparse_allgather after an error")


# ----------------------------------------------------------------------------- bad arguments (every rank)


BAD_ARGUMENTS = {
    "algorithm name": (dict(algorithm="ssar_recursive_halving"), "algorithm must be 'auto' or one of"),
    "transport name": (dict(transport="nccl"), "transport must be one of"),
    "quantize_bits=3": (dict(algorithm="dsar_split_allgather", quantize_bits=3, key=jax.random.key(0)),
                        "quantize_bits must be one of (2, 4, 8)"),
    "quantize_bits without key": (dict(algorithm="dsar_split_allgather", quantize_bits=4), "quantize_bits needs key"),
    "quantize_bits with SSAR": (dict(algorithm="ssar_recursive_doubling", quantize_bits=4, key=jax.random.key(0)),
                                "quantize_bits codes the dense phases"),
}


@pytest.mark.parametrize("case", list(BAD_ARGUMENTS))
def test_bad_argument_raises_everywhere(case):
    kwargs, message = BAD_ARGUMENTS[case]
    expect_error_everywhere(lambda: sparse_allreduce(good_inputs().stream, **kwargs), message, case)
    assert_next_collective_works()


@needs_two_ranks
def test_bad_argument_on_one_rank_inside_user_jit_raises_everywhere():
    """The bad rank finds its error as it traces the step, while its peers already run theirs."""
    bad = RANK == BAD_RANK
    algorithm = "ssar_recursive_halving" if bad else "ssar_split_allgather"
    step = jax.jit(lambda s: sparse_allreduce(s, algorithm=algorithm).to_dense())
    expect_error_everywhere(lambda: step(good_inputs().stream),
                            "algorithm must be 'auto' or one of" if bad else "another rank rejected its arguments",
                            "a bad algorithm on one rank, inside jit")
    sparcml_jax.reset_after_error()
    assert_recovered("ssar_split_allgather")


def test_not_a_stream_raises_everywhere():
    def body():
        try:
            sparse_allreduce(jnp.zeros(SIZE))
        except TypeError as e:
            return [] if "must be a SparseStream" in str(e) else [f"unclear message: {e}"]
        return ["a plain array was accepted"]

    run_and_agree(body, "sparse_allreduce of a plain array")
    assert_next_collective_works()


def test_many_errors_then_every_algorithm_still_works():
    """The error path leaves no stale message behind: every algorithm/transport is still exact."""
    for transport in TRANSPORTS:
        for algorithm in ALGORITHMS_AND_AUTO:
            assert_next_collective_works(algorithm, transport)
    agree_all([], "done")
