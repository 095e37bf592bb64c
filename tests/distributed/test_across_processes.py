"""Every algorithm over a mesh axis that spans processes (``jax.distributed``, gloo): the same
code as on one process's devices, exact on integer data, identical on every device; the global
top-k algorithms equal their numpy references. Every process holds every device's result
(gathered), so all processes pass or fail the same checks."""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparcml_jax as sj
from _util import CASES, MODEL, accumulators, identical_on_every_device, integer_rows, on_mesh

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the references
from global_topk_reference import gtopk_reference, spardl_reference  # noqa: E402

P_ALL = jax.device_count()


def test_the_mesh_spans_processes():
    assert jax.process_count() > 1 and jax.local_device_count() < P_ALL


def test_every_algorithm_is_the_sum_on_every_device():
    algorithms = [*sj.ALGORITHMS, "auto"]
    rows = [integer_rows(P_ALL, n, density, seed=1, support=support) for n, _, density, support in CASES]

    def reduce_all(*xs):
        return [[sj.sparse_allreduce(sj.from_dense(x, capacity=capacity), axis_name="data", algorithm=algorithm,
                                     cost_model=MODEL).to_dense() for x, (_, capacity, _, _) in zip(xs, CASES)]
                for algorithm in algorithms]

    for algorithm, per_case in zip(algorithms, on_mesh(P_ALL, reduce_all, *rows)):
        for got, x, case in zip(per_case, rows, CASES):
            assert identical_on_every_device(got), f"{algorithm} {case}"
            np.testing.assert_array_equal(got[0], x.sum(axis=0), err_msg=f"{algorithm} {case}")


def test_quantized_allgather_dense_and_allgather():
    n = 600
    rows = integer_rows(P_ALL, n, 0.05, seed=2)

    def every_kind(x, key):
        constant = jnp.full((n,), 2.0)
        return (sj.sparse_allreduce(sj.from_dense(constant, capacity=n), axis_name="data", bucket_size=64,
                                    algorithm="dsar_split_allgather", quantize_bits=4, key=key).to_dense(),
                sj.sparse_allgather(sj.from_dense(x, capacity=64), axis_name="data").to_dense(),
                sj.dense_allreduce(x, axis_name="data"))

    quantized, gathered, dense = on_mesh(P_ALL, every_kind, rows, shared=(jax.random.key(5),))
    np.testing.assert_array_equal(quantized, np.full((P_ALL, n), 2.0 * P_ALL, np.float32))
    for out in (gathered, dense):
        assert identical_on_every_device(out)
        np.testing.assert_array_equal(out[0], rows.sum(axis=0))


@pytest.mark.parametrize("algorithm", ["spardl", "gtopk", "oktopk"])
def test_global_topk_books_balance(algorithm):
    n, k = 1001, 10
    x = accumulators(P_ALL, n, seed=3)
    teams = [g for g in range(1, P_ALL + 1) if P_ALL % g == 0] if algorithm == "spardl" else [1]

    def every_run(x):
        runs = []
        for g in teams:
            options = dict(teams=g) if algorithm == "spardl" else {}
            if algorithm == "oktopk":
                options = dict(oktopk_state=sj.init_oktopk_state(nprocs=P_ALL))
            total, residual, *_ = sj.global_topk_allreduce(x, k, axis_name="data", algorithm=algorithm, **options)
            runs.append((total.to_dense(), residual))
        return runs

    for g, (total, residual) in zip(teams, on_mesh(P_ALL, every_run, x)):
        label = f"{algorithm} teams={g}"
        assert identical_on_every_device(total), label
        np.testing.assert_array_equal(total[0] + residual.sum(axis=0), x.sum(axis=0), err_msg=label)
        if algorithm != "oktopk":
            reference = spardl_reference(list(x), k, g) if algorithm == "spardl" else gtopk_reference(list(x), k)
            np.testing.assert_array_equal(total[0], reference[0], err_msg=label)
            np.testing.assert_array_equal(residual, np.stack(reference[2]), err_msg=label)


def test_an_invalid_stream_in_one_process_raises_in_every_process():
    rows = np.zeros((P_ALL, 50), np.float32)
    rows[P_ALL - 1, :20] = 1.0  # 20 nonzeros on the last device (the last process) in a capacity of 8

    def reduce(x):
        return sj.sparse_allreduce(sj.from_dense(x, capacity=8), axis_name="data",
                                   algorithm="ssar_split_allgather").to_dense()

    with pytest.raises(Exception, match=f"stream on device {P_ALL - 1} of axis 'data': nnz=20 does not fit"):
        on_mesh(P_ALL, reduce, rows)
    rows[P_ALL - 1, 8:] = 0.0
    np.testing.assert_array_equal(on_mesh(P_ALL, reduce, rows)[0], rows.sum(axis=0))  # the job goes on
