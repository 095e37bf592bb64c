"""The collectives over a mesh axis (``axis_name=``, XLA's collectives) inside a jitted
``jax.shard_map`` on P = 1..8 forced CPU devices: every algorithm equals the plain sum, bit for bit
on integer data, on every device; the global top-k algorithms are their numpy references
(tests/global_topk_reference.py) with exact books; bad input raises a clear error.

Spawned by tests/test_mesh_spawn.py.
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparcml_jax as sj
from sparcml_jax.comm.topology import part_bounds
from _util import AXIS, CASES, MODEL, accumulators, identical_on_every_device, integer_rows, on_mesh

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the references
from global_topk_reference import (gtopk_reference, initial_oktopk_state, oktopk_step_reference,  # noqa: E402
                                   spardl_reference)
from quantized_dsar_reference import quantized_dsar_reference, split_phase_error  # noqa: E402

SIZES = range(1, 9)


@pytest.mark.parametrize("p", SIZES)
@pytest.mark.parametrize("algorithm", [*sj.ALGORITHMS, "auto"])
def test_sparse_allreduce_is_the_sum_on_every_device(algorithm, p):
    rows = [integer_rows(p, n, density, seed=1, support=support) for n, _, density, support in CASES]

    def reduce_all(*xs):
        out = []
        for x, (_, capacity, _, _) in zip(xs, CASES):
            total, stats = sj.sparse_allreduce(sj.from_dense(x, capacity=capacity), axis_name=AXIS,
                                               algorithm=algorithm, cost_model=MODEL, return_stats=True)
            out.append((total, total.to_dense(), stats))
        return out

    results = on_mesh(p, reduce_all, *rows)
    for (total, dense, stats), x, case in zip(results, rows, CASES):
        label = f"{algorithm} P={p} {case}"
        assert identical_on_every_device((total, dense, stats.algorithm)), label
        np.testing.assert_array_equal(dense[0], x.sum(axis=0), err_msg=label)
        if algorithm == "auto":
            assert 0 <= stats.algorithm[0] < len(sj.ALGORITHMS), label
        else:
            assert (stats.algorithm == sj.ALGORITHMS.index(algorithm)).all(), label
        assert (stats.bytes_sent > 0).all() if p > 1 else (stats.bytes_sent == 0).all(), label


def _bf16(x: np.ndarray) -> np.ndarray:
    return np.asarray(jnp.asarray(x, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32))


@pytest.mark.parametrize("p", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("algorithm", [*sj.ALGORITHMS, "auto"])
def test_bfloat16_wire_on_every_device(algorithm, p):
    """value_dtype=bfloat16 over a mesh axis: small integers (which bfloat16 holds, as every partial
    sum of them) sum exactly, in fewer bytes than float32; fractional values give the same sum on
    every device within bfloat16's rounding of every partial sum sent, and for the dense allreduce
    and DSAR the reference: each owner adds the others' rounded segments to its own in rank order,
    and its sum travels rounded."""
    rows = [integer_rows(p, n, density, seed=7, support=support) for n, _, density, support in CASES]
    rows += [r * np.float32(1.0 / 3.0) + np.where(r != 0, np.float32(1e-3), np.float32(0)) for r in rows]
    capacities = [capacity for _, capacity, _, _ in CASES] * 2

    def reduce_all(*xs):
        out = []
        for x, capacity in zip(xs, capacities):
            stream = sj.from_dense(x, capacity=capacity)
            total, stats = sj.sparse_allreduce(stream, axis_name=AXIS, algorithm=algorithm, cost_model=MODEL,
                                               value_dtype=jnp.bfloat16, return_stats=True)
            wide = sj.sparse_allreduce(stream, axis_name=AXIS, algorithm=algorithm, cost_model=MODEL,
                                       return_stats=True)[1]
            out.append((total.to_dense(), stats, wide.bytes_sent))
        return out

    results = on_mesh(p, reduce_all, *rows)
    for i, ((dense, stats, wide_bytes), x) in enumerate(zip(results, rows)):
        label = f"bfloat16 {algorithm} P={p} {CASES[i % len(CASES)]} {'integers' if i < len(CASES) else 'fractions'}"
        assert identical_on_every_device((dense, stats.algorithm)), label
        if p > 1 and algorithm != "auto":  # (auto may choose another algorithm for either)
            assert (stats.bytes_sent < wide_bytes).all(), f"{label}: {stats.bytes_sent[0]} B, float32 {wide_bytes[0]}"
        if i < len(CASES):
            np.testing.assert_array_equal(dense[0], x.sum(axis=0), err_msg=label)
            continue
        total = x.astype(np.float64).sum(axis=0)
        rounds = int(np.ceil(np.log2(max(p, 2)))) + p
        bound = np.abs(x).astype(np.float64).sum(axis=0) * rounds * 2.0 ** -8
        assert np.all(np.abs(dense[0] - total) <= bound + 1e-6), label
        chosen = sj.ALGORITHMS[int(stats.algorithm[0])]
        if chosen in ("dense", "dsar_split_allgather") and x.shape[1] == capacities[i]:
            want = np.zeros(x.shape[1], np.float32)
            for o in range(p):
                lo, hi = part_bounds(x.shape[1], p, o)
                owned = np.zeros(hi - lo, np.float32)
                for r in range(p):
                    owned = owned + (x[r, lo:hi] if r == o else _bf16(x[r, lo:hi]))
                want[lo:hi] = _bf16(owned)
            np.testing.assert_array_equal(dense[0].view(np.uint32), want.view(np.uint32), err_msg=label)


def test_cost_model_calibrated_on_the_axis_drives_auto():
    p = 3
    mesh = jax.make_mesh((p,), (AXIS,), devices=jax.devices()[:p])
    model = sj.CostModel.calibrate_on_axis(mesh, AXIS)
    assert all(term > 0 for term in (model.alpha, model.beta, model.dense_beta, model.pair_cost, model.element_cost,
                                     model.select_cost)), model
    n, capacity, density, support = CASES[0]
    rows = integer_rows(p, n, density, seed=4, support=support)
    out = on_mesh(p, lambda x: sj.sparse_allreduce(sj.from_dense(x, capacity=capacity), axis_name=AXIS,
                                                  cost_model=model).to_dense(), rows)
    np.testing.assert_array_equal(out[0], rows.sum(axis=0))
    with pytest.raises(ValueError, match=r"axis_name='model' is not an axis of the mesh \(its axes: \('data',\)\)"):
        sj.CostModel.calibrate_on_axis(mesh, "model")


def test_auto_over_every_device_measures_its_model_at_the_first_call():
    p = jax.device_count()
    n, capacity, density, support = CASES[0]
    rows = integer_rows(p, n, density, seed=5, support=support)
    out = on_mesh(p, lambda x: sj.sparse_allreduce(sj.from_dense(x, capacity=capacity), axis_name=AXIS).to_dense(),
                  rows)
    np.testing.assert_array_equal(out[0], rows.sum(axis=0))


def test_quantized_dsar_decodes_the_same_bytes_on_every_device():
    """QSGD on the dense allgather phase: constant ranges are exact, and every device holds the
    same result."""
    p, n = 3, 600
    rows = np.full((p, n), 2.0, np.float32)

    def quantized(x, key):
        return sj.sparse_allreduce(sj.from_dense(x, capacity=n), axis_name=AXIS, algorithm="dsar_split_allgather",
                                   quantize_bits=4, key=key, bucket_size=64).to_dense()

    out = on_mesh(p, quantized, rows, shared=(jax.random.key(5),))
    assert identical_on_every_device(out)
    np.testing.assert_array_equal(out[0], rows.sum(axis=0))


@pytest.mark.parametrize("p,bits", ((1, 4), (3, 2), (5, 8), (8, 4)))
def test_quantized_dsar_equals_its_reference(p, bits):
    """Both phases coded as specified (tests/quantized_dsar_reference.py), bit for bit, on every
    device. Static buffers code a split-phase segment whenever its buffer holds its range (capacity
    N: always; a top-k capacity: never, so those segments stay exact pairs)."""
    n, bucket = 1001, 64
    rows = integer_rows(p, n, 1.0, seed=11).astype(np.float32) * np.float32(0.37)
    sparse = integer_rows(p, n, 0.01, seed=12)
    key = jax.random.key(21)
    for data, capacity in ((rows, n), (sparse, 16)):
        def reduce(x, k, capacity=capacity):
            total, error = sj.sparse_allreduce(sj.from_dense(x, capacity=capacity), axis_name=AXIS,
                                               algorithm="dsar_split_allgather", quantize_bits=bits, key=k,
                                               bucket_size=bucket, quantize_feedback=True)
            return total.to_dense(), error

        out, errors = on_mesh(p, reduce, data, shared=(key,))
        assert identical_on_every_device(out)
        coded = lambda r, o, capacity=capacity: capacity == n  # noqa: E731
        want = quantized_dsar_reference(data, key, bits=bits, bucket=bucket, coded=coded)
        np.testing.assert_array_equal(out[0].view(np.uint32), want.view(np.uint32))
        for d in range(p):  # what each device's split phase lost
            lost = split_phase_error(data.astype(np.float32), d, key, bits=bits, bucket=bucket, coded=coded)
            np.testing.assert_array_equal(errors[d].view(np.uint32), lost.view(np.uint32))


@pytest.mark.parametrize("p", (1, 3, 8))
def test_sparse_allgather_and_dense_allreduce(p):
    n = 40
    rows = np.zeros((p, n), np.float32)
    for d in range(p):
        rows[d, d::8] = d + 1.0  # disjoint supports

    def both(x):
        return (sj.sparse_allgather(sj.from_dense(x, capacity=5), axis_name=AXIS).to_dense(),
                sj.dense_allreduce(x, axis_name=AXIS))

    gathered, summed = on_mesh(p, both, rows)
    for out in (gathered, summed):
        assert identical_on_every_device(out)
        np.testing.assert_array_equal(out[0], rows.sum(axis=0))


GLOBAL_TOPK = {"spardl": spardl_reference, "gtopk": gtopk_reference}
GLOBAL_CASES = ((1001, 10), (1001, 0), (1001, 1001), (3, 2))


def teams_of(p: int) -> list[int]:
    """One team, the fewest teams above one and one rank per team (tests/test_global_topk.py takes
    every divisor on the simulated transport)."""
    divisors = [g for g in range(2, p + 1) if p % g == 0]
    return sorted({1, *divisors[:1], *divisors[-1:]})


@pytest.mark.parametrize("p", SIZES)
def test_global_topk_is_its_reference_with_exact_books(p):
    runs = [(name, teams) for name in GLOBAL_TOPK for teams in (teams_of(p) if name == "spardl" else [1])]
    inputs = [accumulators(p, n, seed=3) for n, _ in GLOBAL_CASES]

    def every_run(*xs):
        return [[sj.global_topk_allreduce(x, k, axis_name=AXIS, algorithm=name, teams=teams, return_stats=True)
                 for x, (_, k) in zip(xs, GLOBAL_CASES)] for name, teams in runs]

    results = on_mesh(p, every_run, *inputs)
    for (name, teams), per_case in zip(runs, results):
        for (total, residual, stats), xs, (n, k) in zip(per_case, inputs, GLOBAL_CASES):
            label = f"{name} teams={teams} P={p} N={n} k={k}"
            reference = spardl_reference(list(xs), k, teams) if name == "spardl" else gtopk_reference(list(xs), k)
            want_total, want_support, want_residuals = reference
            assert identical_on_every_device(total), label
            got = sj.SparseStream(total.indices[0], total.values[0], total.nnz[0], n).to_dense()
            np.testing.assert_array_equal(np.asarray(got), want_total, err_msg=label)
            for d in range(p):
                np.testing.assert_array_equal(residual[d], want_residuals[d], err_msg=f"{label} device {d}")
            np.testing.assert_array_equal(np.asarray(got) + residual.sum(axis=0), xs.sum(axis=0), err_msg=label)
            bound = k + p // teams if name == "spardl" else k
            assert np.count_nonzero(np.asarray(got)) <= min(bound, n), label


@pytest.mark.parametrize("p", (1, 2, 5, 8))
def test_oktopk_carries_its_state_as_its_reference_does(p):
    tau, tau_prime, n, k, steps = 3, 2, 1001, 10, 5
    grads = [accumulators(p, n, seed=10 + s) for s in range(steps)]

    def train(*gs):
        state, residual, out = sj.init_oktopk_state(nprocs=p), jnp.zeros(n), []
        for g in gs:
            total, residual, state = sj.global_topk_allreduce(g + residual, k, axis_name=AXIS, algorithm="oktopk",
                                                              oktopk_state=state, tau=tau, tau_prime=tau_prime)
            out.append((total.to_dense(), residual, state))
        return out

    results = on_mesh(p, train, *grads)
    want, residuals = initial_oktopk_state(p), [np.zeros(n, np.float32) for _ in range(p)]
    for step, (total, residual, state) in enumerate(results):
        xs = [g + r for g, r in zip(grads[step], residuals)]
        want_total, _, residuals, want = oktopk_step_reference(xs, k, want, tau, tau_prime)
        label = f"oktopk P={p} step {step}"
        assert identical_on_every_device(total), label
        np.testing.assert_array_equal(total[0], want_total, err_msg=label)
        np.testing.assert_array_equal(residual, np.stack(residuals), err_msg=label)
        np.testing.assert_array_equal(state.local_threshold, np.asarray(want["local"], np.float32), err_msg=label)
        assert state.step[0] == want["step"] and state.global_threshold[0] == want["global"], label
        np.testing.assert_array_equal(state.starts[0], np.asarray(want["starts"]), err_msg=label)


# ----------------------------------------------------------------------------- bad input


def test_an_invalid_stream_on_one_device_raises_on_every_device_naming_it():
    p, n = 4, 50
    rows = np.zeros((p, n), np.float32)
    rows[2, :20] = 1.0  # 20 nonzeros on device 2 in a capacity of 8

    def reduce(x):
        return sj.sparse_allreduce(sj.from_dense(x, capacity=8), axis_name=AXIS, algorithm="ssar_split_allgather")

    with pytest.raises(Exception, match="stream on device 2 of axis 'data': nnz=20 does not fit its capacity 8"):
        on_mesh(p, reduce, rows)


def test_devices_at_different_oktopk_steps_raise():
    p, n = 2, 64
    rows = np.ones((p, n), np.float32)
    steps = np.arange(p, dtype=np.int32)

    def reduce(x, step):
        state = sj.init_oktopk_state(nprocs=p)._replace(step=step)
        return sj.global_topk_allreduce(x, 4, axis_name=AXIS, algorithm="oktopk", oktopk_state=state)[0].to_dense()

    with pytest.raises(Exception, match="oktopk_state.step differs between the devices of axis 'data'"):
        on_mesh(p, reduce, rows, steps)


@pytest.mark.parametrize("call,match", [
    (lambda x: sj.sparse_allreduce(sj.from_dense(x, capacity=4), axis_name=AXIS, comm=object()),
     "comm and axis_name are exclusive"),
    (lambda x: sj.sparse_allreduce(sj.from_dense(x, capacity=4), axis_name=AXIS, transport="mpi4jax"),
     "transport='mpi4jax' is an MPI transport"),
    (lambda x: sj.sparse_allreduce(sj.from_dense(x, capacity=4), axis_name="model"),
     "axis_name='model' names no mesh axis here"),
    (lambda x: sj.sparse_allreduce(sj.from_dense(x, capacity=4), axis_name=AXIS),
     "algorithm='auto' over a mesh axis of 2 of the 8 devices chooses with a cost model"),
    (lambda x: sj.global_topk_allreduce(x, 2, axis_name=AXIS, teams=3), "teams=3 must divide the number of ranks"),
    (lambda x: sj.dense_allreduce(x, axis_name="model"), "axis_name='model' names no mesh axis here"),
])
def test_bad_arguments_name_themselves(call, match):
    with pytest.raises(ValueError, match=match):
        on_mesh(2, call, np.ones((2, 16), np.float32))
