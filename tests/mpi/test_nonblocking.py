"""Multi-rank tests of the non-blocking allreduce (run under mpirun -n P).

start/wait must give the blocking call's result bit for bit, with several reductions in flight,
inside jit, lax.scan and lax.cond, beside mpi4jax ops in the same program; errors of the
background reduction must surface at wait on every rank. The spawner's timeout turns a deadlock
into a failure.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import mpi4jax
import numpy as np
import pytest
from _util import (
    ALGORITHMS_AND_AUTO,
    COMM,
    NPROCS,
    QUANT_BUCKET,
    QUANT_CASES,
    RANK,
    agree_all,
    agree_on_poisoned_tokens,
    expect_error_everywhere,
    make_stream,
    one_rank_against_its_peers,
    run_and_agree,
)
from mpi4py import MPI
from test_collectives import CONFIGS, bits, check_result, grid, inputs

from sparcml_jax import (
    ALGORITHMS,
    SparseStream,
    sparse_allreduce,
    sparse_allreduce_start,
    sparse_allreduce_wait,
)

BAD_RANK = NPROCS - 1


def same_stream(a: SparseStream, b: SparseStream) -> bool:
    return (a.capacity == b.capacity and int(a.nnz) == int(b.nnz)
            and np.array_equal(np.asarray(a.indices), np.asarray(b.indices))
            and np.array_equal(bits(a.values), bits(b.values)))


@pytest.mark.parametrize("algorithm", ALGORITHMS_AND_AUTO)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_start_wait_equals_blocking_with_all_cases_in_flight(config, algorithm):
    """Every case of the grid is started before the first wait; the waits go in reverse order."""
    cases = [inputs(config, d, kind) for d, kind in grid(config)]

    def body():
        handles = [sparse_allreduce_start(inp.stream, algorithm=algorithm) for inp in cases]
        results = [sparse_allreduce_wait(h, return_stats=True) for h in reversed(handles)][::-1]
        failures = []
        for inp, (out, stats) in zip(cases, results):
            label = f"{config}/{algorithm} {inp}"
            failures += check_result(label, algorithm, inp, out, stats)
            if algorithm != "auto":
                blocking, blocking_stats = sparse_allreduce(inp.stream, algorithm=algorithm, return_stats=True)
                if not same_stream(out, blocking):
                    failures.append(f"{label}: differs from the blocking result")
                if [float(v) for v in stats] != [float(v) for v in blocking_stats]:
                    failures.append(f"{label}: stats {stats} differ from the blocking call's {blocking_stats}")
        return failures

    run_and_agree(body, f"start/wait {config}/{algorithm}")


@pytest.mark.parametrize("bits", sorted({b for t, b in QUANT_CASES if t == "native"}))
def test_quantized_dsar_equals_blocking(bits):
    """QSGD on DSAR's dense phase: the engine draws the same codes from the same key."""
    cases = [inputs("full", d, "random") for d in (0.1, 1.0)]
    key = jax.random.key(bits)

    def body():
        options = dict(algorithm="dsar_split_allgather", quantize_bits=bits, key=key, bucket_size=QUANT_BUCKET)
        handles = [sparse_allreduce_start(inp.stream, **options) for inp in cases]
        failures = []
        for inp, handle in zip(cases, handles):
            out = sparse_allreduce_wait(handle)
            if not same_stream(out, sparse_allreduce(inp.stream, **options)):
                failures.append(f"{bits}-bit DSAR {inp}: differs from the blocking result")
        return failures

    run_and_agree(body, f"quantized DSAR start/wait ({bits} bits)")


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_start_wait_inside_jit_overlaps_a_computation(algorithm):
    a, b = inputs("full", 0.1, "random"), inputs("sparse", 1e-2, "unequal")

    @jax.jit
    def step(s, t, x):
        first = sparse_allreduce_start(s, algorithm=algorithm)
        second = sparse_allreduce_start(t, algorithm=algorithm)
        y = jnp.tanh(x @ x.T).sum()
        return sparse_allreduce_wait(second, after=y), sparse_allreduce_wait(first), y

    def body():
        got_second, got_first, _ = step(a.stream, b.stream, jnp.ones((8, 8)))
        failures = []
        for inp, out in ((a, got_first), (b, got_second)):
            if not np.array_equal(bits(out.to_dense()), bits(inp.total)):
                failures.append(f"{algorithm} {inp}: wrong sum inside jit")
        return failures

    run_and_agree(body, f"start/wait inside jit ({algorithm})")


def test_pipelined_in_lax_scan():
    """Step t starts the reduction of xs[t] and waits for the one of step t - 1 (carried handle)."""
    steps, size = 5, 64
    rng = np.random.default_rng([RANK, 5])
    xs = np.where(rng.random((steps, size)) < 0.2, rng.integers(-9, 10, (steps, size)), 0).astype(np.float32)
    want = COMM.allreduce(xs, op=MPI.SUM)

    def stream(x):
        return SparseStream.from_dense(x, capacity=size)

    @jax.jit
    def pipeline(xs):
        def step(handle, x):
            nxt = sparse_allreduce_start(stream(x), algorithm="ssar_split_allgather")
            return nxt, sparse_allreduce_wait(handle).to_dense()

        first = sparse_allreduce_start(stream(xs[0]), algorithm="ssar_split_allgather")
        last, sums = jax.lax.scan(step, first, xs[1:])
        return jnp.concatenate([sums, sparse_allreduce_wait(last).to_dense()[None]])

    def body():
        got = np.asarray(pipeline(jnp.asarray(xs)))
        return [] if np.array_equal(got, want) else ["lax.scan pipeline: wrong sums"]

    run_and_agree(body, "start/wait pipelined in lax.scan")


@pytest.mark.parametrize("communicate", [True, False])
def test_inside_lax_cond(communicate):
    inp = inputs("sparse", 1e-2, "random")

    @jax.jit
    def maybe_reduce(flag, s):
        def reduce(s):
            return sparse_allreduce_wait(sparse_allreduce_start(s, algorithm="ssar_recursive_doubling")).to_dense()

        return jax.lax.cond(flag, reduce, lambda s: s.to_dense(), s)

    def body():
        got = np.asarray(maybe_reduce(communicate, inp.stream))
        want = inp.total if communicate else inp.x
        return [] if np.array_equal(got, want) else [f"lax.cond({communicate}): wrong result"]

    run_and_agree(body, f"start/wait in lax.cond ({communicate})")


def test_mixed_with_mpi4jax_and_blocking_ops_in_one_program():
    """Reductions in flight on the engine while the main thread runs mpi4jax and blocking collectives."""
    a, b = inputs("full", 0.1, "identical"), inputs("sparse", 1e-3, "random")

    @jax.jit
    def program(s, t, x):
        first = sparse_allreduce_start(s, algorithm="dsar_split_allgather")
        dense = mpi4jax.allreduce(x, op=MPI.SUM, comm=COMM)
        second = sparse_allreduce_start(t, algorithm="ssar_recursive_doubling")
        blocking = sparse_allreduce(t, algorithm="ssar_split_allgather")
        gathered = mpi4jax.allgather(x[:1], comm=COMM)
        return sparse_allreduce_wait(first, after=dense), sparse_allreduce_wait(second), blocking, dense, gathered

    def body():
        x = jnp.full(4, float(RANK + 1))
        first, second, blocking, dense, gathered = program(a.stream, b.stream, x)
        failures = []
        if not np.array_equal(np.asarray(first.to_dense()), a.total):
            failures.append("DSAR in flight beside mpi4jax: wrong sum")
        if not np.array_equal(np.asarray(second.to_dense()), b.total):
            failures.append("recursive doubling in flight beside a blocking collective: wrong sum")
        if not np.array_equal(np.asarray(blocking.to_dense()), b.total):
            failures.append("blocking collective beside the engine: wrong sum")
        if not np.array_equal(np.asarray(dense), np.full(4, NPROCS * (NPROCS + 1) / 2)):
            failures.append("mpi4jax allreduce beside the engine: wrong sum")
        if not np.array_equal(np.asarray(gathered)[:, 0], np.arange(1, NPROCS + 1)):
            failures.append("mpi4jax allgather beside the engine: wrong result")
        return failures

    run_and_agree(body, "engine beside mpi4jax")


# ----------------------------------------------------------------------------- errors at wait


def assert_recovered() -> None:
    agree_all(agree_on_poisoned_tokens(), "no stale error left in JAX's runtime token")
    inp = inputs("sparse", 1e-2, "random")

    def body():
        out = sparse_allreduce_wait(sparse_allreduce_start(inp.stream, algorithm="ssar_split_allgather"))
        return [] if np.array_equal(np.asarray(out.to_dense()), inp.total) else ["reduction after an error: wrong sum"]

    run_and_agree(body, "a good reduction after an error")


def unsorted_stream_on_bad_rank() -> SparseStream:
    support = np.array([5, 3], np.int32) if RANK == BAD_RANK else np.array([3, 5], np.int32)
    return make_stream(support, np.ones(2, np.float32), 1000, 24)


def test_invalid_stream_on_one_rank_raises_at_wait_everywhere():
    bad = unsorted_stream_on_bad_rank()
    expect_error_everywhere(
        lambda: sparse_allreduce_wait(sparse_allreduce_start(bad, algorithm="ssar_recursive_doubling")),
        lambda r: "strictly increasing" if r == BAD_RANK else f"invalid input stream on rank {BAD_RANK}",
        "an unsorted stream on one rank",
    )
    assert_recovered()


@pytest.mark.skipif(NPROCS < 2, reason="a disagreement needs two ranks")
def test_ranks_disagreeing_on_size_raise_at_wait_everywhere():
    size = 1001 if RANK == BAD_RANK else 1000
    s = make_stream(np.array([RANK], np.int32), np.ones(1, np.float32), size, 24)
    expect_error_everywhere(lambda: sparse_allreduce_wait(sparse_allreduce_start(s, algorithm="dense")),
                            "ranks disagree on size", "sizes differing between ranks")
    assert_recovered()


@pytest.mark.skipif(NPROCS < 2, reason="a disagreement needs two ranks")
def test_argument_error_on_one_rank_fails_the_peers_reduction():
    inp = inputs("sparse", 1e-2, "random")
    algorithm = "ssar_recursive_halving" if RANK == BAD_RANK else "ssar_recursive_doubling"
    expect_error_everywhere(
        lambda: sparse_allreduce_wait(sparse_allreduce_start(inp.stream, algorithm=algorithm)),
        lambda r: "algorithm must be" if r == BAD_RANK else "rejected its arguments",
        "a bad algorithm name on one rank",
    )
    assert_recovered()


@one_rank_against_its_peers
@pytest.mark.parametrize("bad, message", [(dict(quantize_bits=3), "quantize_bits must be one of"),
                                          (dict(algorithm="bogus"), "algorithm must be")])
def test_argument_error_on_one_rank_at_the_first_auto_call(bad, message):
    """The peers are about to calibrate the cost model for their first job; the bad rank, which
    need not know that (its own algorithm may be the bad argument), rejects on the engine, where
    the peers agree before they calibrate."""
    inp = inputs("sparse", 1e-2, "random")
    comm = COMM.Dup()  # a communicator that auto has not calibrated yet
    options = bad if RANK == BAD_RANK else {}
    expect_error_everywhere(
        lambda: sparse_allreduce_wait(sparse_allreduce_start(inp.stream, comm=comm, key=jax.random.key(0), **options)),
        lambda r: message if r == BAD_RANK else "rejected its arguments",
        f"{bad} on one rank, at the first auto call on a communicator",
    )

    def first_good_call():  # every rank calibrates now
        out = sparse_allreduce_wait(sparse_allreduce_start(inp.stream, comm=comm))
        return [] if np.array_equal(np.asarray(out.to_dense()), inp.total) else ["wrong sum"]

    run_and_agree(first_good_call, "the first good auto call after the rejection")
    assert_recovered()


def test_each_handle_is_waited_on_once():
    inp = inputs("sparse", 1e-2, "random")
    handle = sparse_allreduce_start(inp.stream, algorithm="ssar_recursive_doubling")
    sparse_allreduce_wait(handle)
    expect_error_everywhere(lambda: sparse_allreduce_wait(handle), "no reduction in flight", "a second wait")
    assert_recovered()
