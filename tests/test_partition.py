"""from_dense, coalesce, to_dense, scatter_add, partition_bounds, split, gather, pack, unpack and
to_dense_parts: C kernels vs jnp references vs numpy."""

import doctest
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sparcml_jax
from sparcml_jax import SparseStream, dense_threshold
from sparcml_jax.kernels import partition
from sparcml_jax.kernels.partition import (
    coalesce,
    coalesce_reference,
    from_dense,
    from_dense_reference,
    gather,
    gather_reference,
    pack,
    pack_reference,
    partition_bounds,
    scatter_add,
    scatter_add_reference,
    split,
    split_reference,
    to_dense,
    to_dense_parts,
    to_dense_parts_reference,
    to_dense_reference,
    unpack,
    unpack_reference,
)

ERRORS = (ValueError, RuntimeError)


# ------------------------------------------------------------------ helpers and numpy oracles


def make_stream(idx, val, size, capacity=None):
    idx, val = np.asarray(idx, np.int32), np.asarray(val, np.float32)
    capacity = len(idx) if capacity is None else capacity
    pad = capacity - len(idx)
    return SparseStream(
        jnp.asarray(np.concatenate([idx, np.full(pad, size, np.int32)])),
        jnp.asarray(np.concatenate([val, np.zeros(pad, np.float32)])),
        jnp.int32(len(idx)),
        size,
    )


def random_stream(rng, size, nnz, capacity=None):
    idx = np.sort(rng.choice(size, nnz, replace=False))
    return make_stream(idx, rng.integers(-50, 50, nnz), size, capacity)


def dense_stream(x, capacity=None):
    x = np.asarray(x, np.float32)
    return make_stream(np.arange(x.size), x, x.size, capacity)


def sparse_vector(rng, size, nnz):
    x = np.zeros(size, np.float32)
    x[rng.choice(size, nnz, replace=False)] = rng.choice([-3.0, -1.0, 0.5, 2.0, 7.0], nnz)
    return x


def np_from_dense(x, capacity=None, delta=1.0):
    """(indices, values, nnz) of the expected stream; past ``capacity``, the first nonzeros and the true count."""
    size = x.size
    capacity = size if capacity is None else capacity
    (pos,) = np.nonzero(x != 0)
    if capacity >= size and len(pos) >= dense_threshold(size, delta):
        pos = np.arange(size)
    return padded(pos, x[pos], size, capacity)


def padded(support, values, size, capacity):
    """The stream (indices, values, nnz) of ``support`` in ``capacity`` slots: nnz is the true count."""
    stored = min(support.size, capacity)
    idx = np.concatenate([support[:stored], np.full(capacity - stored, size)]).astype(np.int32)
    val = np.concatenate([values[:stored], np.zeros(capacity - stored)]).astype(np.float32)
    return idx, val, support.size


def np_dense_of(s):
    out = np.zeros(s.size, np.float32)
    n = int(s.nnz)
    np.add.at(out, np.asarray(s.indices)[:n], np.asarray(s.values)[:n])
    return out


def np_bounds(size, parts):
    step = size // parts
    return np.array([r * step for r in range(parts)] + [size])


def np_split(s, parts):
    n = int(s.nnz)
    return np.searchsorted(np.asarray(s.indices)[:n], np_bounds(s.size, parts), side="left")


def assert_same_stream(x, y):
    assert x.size == y.size and x.capacity == y.capacity
    assert int(x.nnz) == int(y.nnz)
    np.testing.assert_array_equal(np.asarray(x.indices), np.asarray(y.indices))
    np.testing.assert_array_equal(np.asarray(x.values), np.asarray(y.values))


def assert_stream_equals(s, idx, val, nnz):
    assert int(s.nnz) == nnz
    np.testing.assert_array_equal(np.asarray(s.indices), idx)
    np.testing.assert_array_equal(np.asarray(s.values), val)


def stack(streams):
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *streams)


def unstack(stream, i):
    return jax.tree.map(lambda leaf: leaf[i], stream)


# ------------------------------------------------------------------ from_dense


@pytest.mark.parametrize(
    "size,nnz,capacity,delta",
    [
        (0, 0, None, 1.0), (1, 0, None, 1.0), (1, 1, None, 1.0), (1, 1, 1, 0.5), (2, 1, None, 1.0),
        (10, 0, 3, 1.0), (10, 3, 3, 1.0), (10, 4, None, 1.0), (10, 5, None, 1.0), (10, 5, 12, 1.0),
        (10, 6, 8, 1.0),  # count above the threshold but capacity < size: stays sparse
        (100, 7, 20, 1.0), (100, 24, None, 0.5), (100, 25, None, 0.5), (100, 100, None, 1.0),
        (100, 60, None, 3.0),  # threshold 150 > size: never dense
    ],
)
def test_from_dense_matches_numpy_and_reference(size, nnz, capacity, delta):
    rng = np.random.default_rng(size * 1000 + nnz)
    x = sparse_vector(rng, size, nnz)
    fn = jax.jit(functools.partial(from_dense, capacity=capacity, delta=delta))
    out = fn(x)
    assert_stream_equals(out, *np_from_dense(x, capacity, delta))
    assert_same_stream(out, jax.jit(from_dense_reference, static_argnums=(1, 2))(x, capacity, delta))
    np.testing.assert_array_equal(np.asarray(jax.jit(SparseStream.to_dense)(out)), x)


def test_eager_calls():
    rng = np.random.default_rng(0)
    x = sparse_vector(rng, 12, 3)
    s = from_dense(x, capacity=5)
    assert_stream_equals(s, *np_from_dense(x, 5))
    np.testing.assert_array_equal(np.asarray(scatter_add(s, np.ones(12, np.float32))), x + 1)
    np.testing.assert_array_equal(np.asarray(split(s, 3)), np_split(s, 3))
    assert_same_stream(gather(x, s.indices, s.nnz), s)


def test_from_dense_nan_inf_and_negative_zero():
    x = np.array([0.0, np.nan, -0.0, np.inf, 0.0, -np.inf, 0.0, 0.0, 0.0, 0.0], np.float32)
    out = from_dense(x, capacity=4)
    assert int(out.nnz) == 3
    np.testing.assert_array_equal(np.asarray(out.indices), [1, 3, 5, 10])
    np.testing.assert_array_equal(np.asarray(out.values), [np.nan, np.inf, -np.inf, 0.0])
    assert_same_stream(out, from_dense_reference(jnp.asarray(x), 4))


@pytest.mark.parametrize("size", [31, 32, 33, 1000, 4099])
def test_from_dense_skips_zero_blocks_but_no_special_value(size):
    """The kernels skip blocks of zeros by their bits: -0.0 is zero; NaN and infinities are not,
    wherever they sit in a block, up to a tail shorter than a block. Subnormals count as zero, as
    everywhere in XLA:CPU (it flushes denormals), and as in the jnp reference."""
    rng = np.random.default_rng(size)
    x = np.zeros(size, np.float32)
    specials = np.array([np.nan, np.inf, -np.inf, 1e-45, -1e-45, 3.0], np.float32)
    at = rng.choice(size, min(size // 3, 40), replace=False)
    x[at] = rng.choice(specials, at.size)
    x[rng.choice(size, 5)] = -0.0
    x[-1] = 1e-45
    nonzero = np.flatnonzero((x != 0) & ~(np.abs(x) < np.finfo(np.float32).tiny))
    out = from_dense(x, capacity=size // 2)
    assert_same_stream(out, from_dense_reference(jnp.asarray(x), size // 2))
    np.testing.assert_array_equal(np.asarray(out.indices)[: int(out.nnz)], nonzero)
    assert int(out.nnz) == nonzero.size
    for capacity in (0, nonzero.size // 2, nonzero.size, size):
        counted, count = partition.from_dense_counted(x, capacity)
        assert int(count) == nonzero.size
        np.testing.assert_array_equal(np.asarray(counted.indices)[: int(counted.nnz)], nonzero[:capacity])
        np.testing.assert_array_equal(np.asarray(counted.values)[: int(counted.nnz)].view(np.uint32),
                                      x[nonzero[:capacity]].view(np.uint32))


def test_from_dense_under_vmap():
    rng = np.random.default_rng(7)
    xs = np.stack([sparse_vector(rng, 30, k) for k in (0, 3, 9, 15, 30)])
    fn = functools.partial(from_dense, capacity=30)
    out = jax.vmap(fn)(xs)
    ref = jax.vmap(functools.partial(from_dense_reference, capacity=30))(xs)
    for i, x in enumerate(xs):
        assert_stream_equals(unstack(out, i), *np_from_dense(x, 30))
        assert_same_stream(unstack(out, i), unstack(ref, i))
    np.testing.assert_array_equal(np.asarray(jax.vmap(SparseStream.to_dense)(out)), xs)


def test_from_dense_overflow_gives_a_stream_every_consumer_rejects():
    """Raising in from_dense would stop one rank before a collective its peers wait in; the
    overflowed stream (true count in nnz) instead fails every consumer, and in a collective every
    rank (tests/mpi/test_collective_errors.py)."""
    x = np.zeros(40, np.float32)
    x[5:17] = np.arange(1, 13)
    fn = jax.jit(functools.partial(from_dense, capacity=8))
    for s in (from_dense(x, capacity=8), fn(x)):
        assert_stream_equals(s, *np_from_dense(x, 8))
        assert int(s.nnz) == 12
        assert_same_stream(s, from_dense_reference(jnp.asarray(x), 8))
    msg = r"nnz=12 exceeds its capacity 8 \(from_dense, coalesce and merge return the true count"
    for _ in range(2):  # first call and warm call surface different exception classes
        with pytest.raises(ERRORS, match=msg):
            jax.jit(lambda v: from_dense(v, capacity=8).to_dense())(x).block_until_ready()
    with pytest.raises(ERRORS, match=msg):
        jax.vmap(lambda v: from_dense(v, capacity=8).to_dense())(np.stack([x, x])).block_until_ready()



@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda: from_dense(np.ones((2, 3), np.float32)), ValueError, "x must be a 1-D vector"),
        (lambda: from_dense(np.ones(3, np.int32)), TypeError, "x must have dtype float32"),
        (lambda: from_dense(np.ones(3, np.float32), capacity=-1), ValueError, r"capacity must lie in \[0,"),
        (lambda: from_dense(np.ones(3, np.float32), capacity=2.0), TypeError, "capacity must be a Python int"),
        (lambda: from_dense(np.ones(3, np.float32), delta=0.0), ValueError, "delta must be positive"),
        (lambda: jax.eval_shape(from_dense, jax.ShapeDtypeStruct((2**31,), jnp.float32)), ValueError,
         r"x.size=2147483648 does not fit int32 indices"),
    ],
)
def test_from_dense_static_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


# ------------------------------------------------------------------ coalesce


def np_coalesce(idx, val, size, capacity=None, delta=1.0):
    """(indices, values, nnz) of the expected stream; past ``capacity``, the first indices and the true count."""
    idx, val = np.asarray(idx).ravel(), np.asarray(val, np.float32).ravel()
    capacity = idx.size if capacity is None else capacity
    kept = idx < size
    dense = np.zeros(size, np.float32)
    np.add.at(dense, idx[kept], val[kept])
    support = np.unique(idx[kept])
    if capacity >= size and support.size >= dense_threshold(size, delta):
        support = np.arange(size)
    return padded(support, dense[support], size, capacity)


@settings(max_examples=25, deadline=None)
@given(
    size=st.integers(0, 40),
    pairs=st.integers(0, 60),
    capacity_extra=st.one_of(st.none(), st.integers(-3, 50)),
    delta=st.sampled_from([0.5, 1.0, 3.0]),
    seed=st.integers(0, 2**16),
)
def test_coalesce_matches_numpy_and_reference(size, pairs, capacity_extra, delta, seed):
    """Integer-valued pairs (exact sums in any order), repeats, padding (index == size) and overflow."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, size + 1, pairs).astype(np.int32)
    val = rng.integers(-9, 10, pairs).astype(np.float32)
    distinct = np.unique(idx[idx < size]).size
    capacity = None if capacity_extra is None else max(0, distinct + capacity_extra)
    expected = np_coalesce(idx, val, size, capacity, delta)
    fn = jax.jit(functools.partial(coalesce, size=size, capacity=capacity, delta=delta))
    assert_stream_equals(fn(idx, val), *expected)
    reference = jax.jit(functools.partial(coalesce_reference, size=size, capacity=capacity, delta=delta))
    assert_same_stream(fn(idx, val), reference(jnp.asarray(idx), jnp.asarray(val)))


@pytest.mark.parametrize("size", [1, 1000, 2**11, 2**11 + 1, 2**22 + 3, 2**31 - 1])
def test_coalesce_sorts_every_digit(size):
    """Indices spanning one, two and three radix digits, including the largest int32 index."""
    rng = np.random.default_rng(size % 1000)
    idx = np.concatenate([rng.integers(0, size, 300), [size - 1, 0, size - 1]]).astype(np.int32)
    val = rng.integers(-5, 6, idx.size).astype(np.float32)
    out = coalesce(idx, val, size=size)
    support = np.unique(idx)
    np.testing.assert_array_equal(np.asarray(out.indices)[: int(out.nnz)], support)
    sums = np.zeros(support.size, np.float32)
    np.add.at(sums, np.searchsorted(support, idx), val)
    np.testing.assert_array_equal(np.asarray(out.values)[: int(out.nnz)], sums)


def test_coalesce_is_the_gradient_of_a_lookup():
    """coalesce(ids, grad w.r.t. w[ids]) equals jax.grad through the lookup, padding ids included."""
    size = 50
    ids = np.array([[3, 7, 50], [7, 7, 1]], np.int32)  # 50 == size: padding, as with mode="fill"
    vals = np.array([[1.0, 2.0, 0.0], [0.5, 1.5, 4.0]], np.float32)
    w = jnp.linspace(-1.0, 1.0, size)

    def loss_of_rows(rows):
        return jnp.sum(jnp.tanh(rows * vals))

    def loss(w):
        return loss_of_rows(jnp.take(w, ids, mode="fill", fill_value=0.0))

    rows_grad = jax.grad(loss_of_rows)(jnp.take(w, ids, mode="fill", fill_value=0.0))
    stream = coalesce(ids, rows_grad, size=size)
    np.testing.assert_allclose(np.asarray(stream.to_dense()), np.asarray(jax.grad(loss)(w)), rtol=1e-6)
    assert int(stream.nnz) == 3


def test_coalesce_under_vmap_and_float_sums():
    rng = np.random.default_rng(5)
    idx = rng.integers(0, 30, (4, 25)).astype(np.int32)
    val = rng.standard_normal((4, 25)).astype(np.float32)
    out = jax.vmap(lambda i, v: coalesce(i, v, size=30))(idx, val)
    ref = jax.vmap(lambda i, v: coalesce_reference(i, v, 30))(idx, val)
    for b in range(4):
        dense = np.zeros(30, np.float32)
        np.add.at(dense, idx[b], val[b])
        np.testing.assert_allclose(np.asarray(unstack(out, b).to_dense()), dense, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(unstack(out, b).values), np.asarray(unstack(ref, b).values), rtol=1e-6)
        np.testing.assert_array_equal(np.asarray(unstack(out, b).indices), np.asarray(unstack(ref, b).indices))


@pytest.mark.parametrize("bad,position", [(11, 1), (-1, 0), (2**31 - 1, 2)])
def test_coalesce_out_of_range_index_gives_a_stream_every_consumer_rejects(bad, position):
    idx = np.array([2, 3, 4, 10], np.int32)
    idx[position] = bad
    val = np.arange(1, 5, dtype=np.float32)
    fn = jax.jit(functools.partial(coalesce, size=10, capacity=3))
    for s in (coalesce(idx, val, size=10, capacity=3), fn(idx, val)):
        assert_stream_equals(s, np.array([bad, 10, 10], np.int32), np.array([val[position], 0, 0], np.float32), 1)
        assert_same_stream(s, coalesce_reference(jnp.asarray(idx), jnp.asarray(val), 10, 3))
        with pytest.raises(ERRORS, match=rf"indices must lie in \[0, n=10\); found {bad} \(coalesce keeps the first "
                                         r"index outside \[0, size\] it finds\); fix the indices"):
            s.to_dense().block_until_ready()


def test_coalesce_capacity_overflow_keeps_the_first_indices_and_the_true_count():
    s = coalesce(np.array([3, 1, 2, 3], np.int32), np.ones(4, np.float32), size=10, capacity=2)
    assert_stream_equals(s, np.array([1, 2], np.int32), np.array([1, 1], np.float32), 3)
    with pytest.raises(ERRORS, match="nnz=3 exceeds its capacity 2"):
        s.to_dense().block_until_ready()



@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda: coalesce(np.ones(3, np.int32), np.ones(2, np.float32), 8), ValueError,
         "indices and values must have the same shape"),
        (lambda: coalesce(np.ones(3, np.float32), np.ones(3, np.float32), 8), TypeError,
         "indices must have dtype int32"),
        (lambda: coalesce(np.ones(3, np.int32), np.ones(3, np.int32), 8), TypeError,
         "values must have dtype float32"),
        (lambda: coalesce(np.ones(3, np.int32), np.ones(3, np.float32), 2**31), ValueError,
         "size=2147483648 does not fit int32"),
        (lambda: coalesce(np.ones(3, np.int32), np.ones(3, np.float32), 8, capacity=-1), ValueError,
         r"capacity must lie in \[0,"),
    ],
)
def test_coalesce_static_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


# ------------------------------------------------------------------ scatter_add


@pytest.mark.parametrize("size,nnz,capacity", [(0, 0, 0), (1, 0, 1), (1, 1, 1), (10, 0, 4), (10, 3, 3),
                                               (10, 3, 7), (100, 40, 50), (100, 99, 100)])
def test_scatter_add_matches_numpy_and_reference(size, nnz, capacity):
    rng = np.random.default_rng(size + 31 * nnz)
    s = random_stream(rng, size, nnz, capacity)
    base = rng.integers(-9, 9, size).astype(np.float32)
    want = base + np_dense_of(s)
    np.testing.assert_array_equal(np.asarray(jax.jit(scatter_add)(s, base)), want)
    np.testing.assert_array_equal(np.asarray(jax.jit(scatter_add_reference)(s, base)), want)


@pytest.mark.parametrize("size,capacity", [(1, 1), (7, 7), (7, 10)])
def test_scatter_add_dense_form(size, capacity):
    x = np.arange(1, size + 1, dtype=np.float32)
    s = dense_stream(x, capacity)
    base = np.full(size, 0.5, np.float32)
    np.testing.assert_array_equal(np.asarray(scatter_add(s, base)), x + 0.5)
    np.testing.assert_array_equal(np.asarray(scatter_add_reference(s, jnp.asarray(base))), x + 0.5)


def test_scatter_add_leaves_input_untouched_and_vmaps():
    rng = np.random.default_rng(3)
    streams = [random_stream(rng, 20, k, 8) for k in (0, 4, 8)]
    base = jnp.ones((3, 20), jnp.float32)
    out = jax.vmap(scatter_add)(stack(streams), base)
    np.testing.assert_array_equal(np.asarray(base), 1.0)  # the in-place kernel works on a copy
    for i, s in enumerate(streams):
        np.testing.assert_array_equal(np.asarray(out[i]), 1.0 + np_dense_of(s))
    ref = jax.vmap(scatter_add_reference)(stack(streams), base)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))


def test_scatter_add_static_errors():
    s = make_stream([1, 3], [1.0, 2.0], 10)
    with pytest.raises(ValueError, match="dense has length 9 but stream describes a vector of size 10"):
        scatter_add(s, jnp.zeros(9))
    with pytest.raises(TypeError, match="dense must have dtype float32"):
        scatter_add(s, jnp.zeros(10, jnp.int32))
    with pytest.raises(ValueError, match="dense must be a 1-D vector"):
        scatter_add(s, jnp.zeros((2, 5)))
    with pytest.raises(TypeError, match="stream must be a SparseStream"):
        scatter_add(jnp.zeros(10), jnp.zeros(10))


# ------------------------------------------------------------------ to_dense


@pytest.mark.parametrize("size,nnz,capacity", [(0, 0, 0), (1, 0, 1), (1, 1, 1), (10, 0, 4), (10, 3, 7),
                                               (100, 40, 50), (100, 99, 100), (100, 100, 100), (100, 100, 130)])
def test_to_dense_matches_numpy_and_reference(size, nnz, capacity):
    rng = np.random.default_rng(size + 17 * nnz)
    s = random_stream(rng, size, nnz, capacity)
    want = np_dense_of(s)
    np.testing.assert_array_equal(np.asarray(jax.jit(to_dense)(s)), want)
    np.testing.assert_array_equal(np.asarray(jax.jit(to_dense_reference)(s)), want)
    np.testing.assert_array_equal(np.asarray(s.to_dense()), want)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 300).flatmap(lambda n: st.tuples(st.just(n), st.sets(st.integers(0, n - 1)))))
def test_to_dense_any_gaps(case):
    # Supports of every shape: empty, full, runs and gaps of every length.
    size, support = case
    idx = np.array(sorted(support), np.int32)
    s = make_stream(idx, np.arange(1, idx.size + 1), size, capacity=idx.size + 3)
    want = np.zeros(size, np.float32)
    want[idx] = np.arange(1, idx.size + 1)
    np.testing.assert_array_equal(np.asarray(to_dense(s)), want)
    np.testing.assert_array_equal(np.asarray(jax.jit(to_dense_reference)(s)), want)


def test_to_dense_of_a_stream_dense_by_construction_is_its_values():
    x = jnp.arange(6, dtype=jnp.float32)
    s = SparseStream.dense(x)
    assert to_dense(s) is s.values and s.to_dense() is s.values
    np.testing.assert_array_equal(np.asarray(to_dense_reference(s)), np.asarray(x))


@pytest.mark.parametrize("density", [0.0, 0.001, 0.3, 0.9, 1.0])
def test_to_dense_across_blocks(density):
    # The kernel works in blocks of 4096 entries: supports that cross several of them.
    size = 3 * 4096 + 123
    x = sparse_vector(np.random.default_rng(int(density * 1000)), size, int(density * size))
    s = from_dense(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(to_dense(s)), x)
    np.testing.assert_array_equal(np.asarray(to_dense_reference(s)), x)


def test_to_dense_vmaps():
    rng = np.random.default_rng(5)
    streams = [random_stream(rng, 40, k, 12) for k in (0, 5, 12)]
    out = jax.vmap(to_dense)(stack(streams))
    for i, s in enumerate(streams):
        np.testing.assert_array_equal(np.asarray(out[i]), np_dense_of(s))


# ------------------------------------------------------------------ partition_bounds / split


@pytest.mark.parametrize("size,parts", [(0, 1), (0, 3), (1, 1), (1, 4), (10, 1), (10, 3), (10, 10), (10, 11),
                                        (12, 4), (7, 2)])
def test_partition_bounds(size, parts):
    bounds = partition_bounds(size, parts)
    assert bounds.dtype == np.int64 and bounds.shape == (parts + 1,)
    np.testing.assert_array_equal(bounds, np_bounds(size, parts))
    assert bounds[0] == 0 and bounds[-1] == size and np.all(np.diff(bounds) >= 0)
    widths = np.diff(bounds)
    assert np.all(widths[:-1] == size // parts) and widths[-1] == size // parts + size % parts


@pytest.mark.parametrize("size,parts,exc,match", [
    (10, 0, ValueError, r"parts must lie in \[1,"),
    (10, -2, ValueError, r"parts must lie in \[1,"),
    (10, 2.0, TypeError, "parts must be a Python int"),
    (-1, 2, ValueError, r"size=-1 does not fit int32"),
])
def test_partition_bounds_errors(size, parts, exc, match):
    with pytest.raises(exc, match=match):
        partition_bounds(size, parts)


@pytest.mark.parametrize("size,nnz,capacity,parts", [
    (0, 0, 0, 2), (1, 0, 1, 1), (1, 1, 1, 3), (10, 0, 4, 3), (10, 3, 5, 3), (10, 4, 4, 11), (10, 9, 9, 4),
    (100, 17, 20, 4), (100, 17, 20, 7), (1000, 300, 300, 8), (1000, 1, 2, 5),
])
def test_split_matches_numpy_and_reference(size, nnz, capacity, parts):
    rng = np.random.default_rng(size + nnz + parts)
    s = random_stream(rng, size, nnz, capacity)
    want = np_split(s, parts)
    out = jax.jit(split, static_argnums=1)(s, parts)
    assert out.dtype == jnp.int32 and out.shape == (parts + 1,)
    np.testing.assert_array_equal(np.asarray(out), want)
    np.testing.assert_array_equal(np.asarray(jax.jit(split_reference, static_argnums=1)(s, parts)), want)
    # every pair lands in the part that covers its index
    bounds, idx = partition_bounds(size, parts), np.asarray(s.indices)
    for r in range(parts):
        assert np.all((bounds[r] <= idx[out[r]:out[r + 1]]) & (idx[out[r]:out[r + 1]] < bounds[r + 1]))


@pytest.mark.parametrize("size,capacity,parts", [(1, 1, 1), (1, 2, 3), (10, 10, 3), (10, 12, 10), (10, 10, 13)])
def test_split_dense_stream_gives_bounds(size, capacity, parts):
    s = dense_stream(np.arange(size, dtype=np.float32), capacity)
    want = partition_bounds(size, parts)
    np.testing.assert_array_equal(np.asarray(split(s, parts)), want)
    np.testing.assert_array_equal(np.asarray(split_reference(s, parts)), want)


def test_split_under_vmap():
    rng = np.random.default_rng(11)
    streams = [random_stream(rng, 50, k, 50) for k in (0, 5, 12, 49)] + [dense_stream(np.ones(50))]
    out = jax.vmap(lambda s: split(s, 4))(stack(streams))
    ref = jax.vmap(lambda s: split_reference(s, 4))(stack(streams))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
    for i, s in enumerate(streams):
        np.testing.assert_array_equal(np.asarray(out[i]), np_split(s, 4))


def test_split_static_errors():
    s = make_stream([1], [1.0], 10)
    with pytest.raises(ValueError, match=r"parts must lie in \[1,"):
        split(s, 0)
    with pytest.raises(TypeError, match="parts must be a Python int"):
        split(s, jnp.int32(2))
    with pytest.raises(TypeError, match="stream must be a SparseStream"):
        split(np.zeros(3), 2)


# ------------------------------------------------------------------ gather


@pytest.mark.parametrize("size,nnz,capacity", [(0, 0, 0), (1, 0, 1), (1, 1, 1), (10, 0, 3), (10, 3, 3),
                                               (10, 3, 8), (100, 30, 40)])
def test_gather_matches_numpy_and_reference(size, nnz, capacity):
    rng = np.random.default_rng(size * 7 + nnz)
    x = rng.integers(-20, 20, size).astype(np.float32)
    idx = np.sort(rng.choice(size, nnz, replace=False)).astype(np.int32)
    garbage = rng.integers(-5, 5, capacity - nnz).astype(np.int32)  # ignored past nnz
    indices = np.concatenate([idx, garbage])
    want_idx = np.concatenate([idx, np.full(capacity - nnz, size)])
    want_val = np.concatenate([x[idx], np.zeros(capacity - nnz)])
    for out in (jax.jit(gather)(x, indices, nnz), jax.jit(gather_reference)(x, indices, nnz)):
        assert out.size == size
        assert_stream_equals(out, want_idx, want_val, nnz)


@pytest.mark.parametrize("size,capacity", [(1, 1), (6, 6), (6, 9)])
def test_gather_dense_form(size, capacity):
    x = np.arange(10, 10 + size, dtype=np.float32)
    indices = np.full(capacity, 77, np.int32)  # ignored: nnz == size means the dense form
    want_idx = np.concatenate([np.arange(size), np.full(capacity - size, size)])
    want_val = np.concatenate([x, np.zeros(capacity - size)])
    assert_stream_equals(gather(x, indices, size), want_idx, want_val, size)
    assert_stream_equals(gather_reference(jnp.asarray(x), jnp.asarray(indices), size), want_idx, want_val, size)


def test_gather_under_vmap_and_round_trip():
    rng = np.random.default_rng(5)
    xs = rng.integers(1, 9, (3, 16)).astype(np.float32)
    supports = [np.sort(rng.choice(16, 5, replace=False)) for _ in range(3)]
    indices = np.stack([np.concatenate([s, [16, 16]]) for s in supports]).astype(np.int32)
    nnz = np.array([5, 3, 0], np.int32)
    out = jax.vmap(gather)(xs, indices, nnz)
    ref = jax.vmap(gather_reference)(xs, indices, nnz)
    for i in range(3):
        assert_same_stream(unstack(out, i), unstack(ref, i))
        want = np.zeros(16, np.float32)
        want[supports[i][: nnz[i]]] = xs[i][supports[i][: nnz[i]]]
        np.testing.assert_array_equal(np.asarray(unstack(out, i).to_dense()), want)


def test_gather_static_errors():
    with pytest.raises(TypeError, match="indices must have dtype int32"):
        gather(jnp.zeros(4), jnp.zeros(2), 1)
    with pytest.raises(TypeError, match="dense must have dtype float32"):
        gather(jnp.zeros(4, jnp.int32), jnp.zeros(2, jnp.int32), 1)
    with pytest.raises(TypeError, match="nnz must be an integer scalar"):
        gather(jnp.zeros(4), jnp.zeros(2, jnp.int32), jnp.array([1]))
    with pytest.raises(TypeError, match="nnz must be an integer scalar"):
        gather(jnp.zeros(4), jnp.zeros(2, jnp.int32), 1.0)


# ------------------------------------------------------------------ pack / unpack / to_dense_parts


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32])
@pytest.mark.parametrize("sizes", [[0], [5], [3, 0, 4], [0, 0], [4096, 1, 8193], [1] * 40])
def test_pack_and_unpack_match_numpy_and_reference(sizes, dtype):
    rng = np.random.default_rng(sum(sizes) + len(sizes))
    parts = [jnp.asarray(rng.integers(-99, 99, m), dtype) for m in sizes]
    want = np.concatenate([np.asarray(p) for p in parts])
    flat = jax.jit(pack)(parts)
    assert flat.dtype == dtype
    np.testing.assert_array_equal(np.asarray(flat), want)
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda ps: pack_reference(*ps))(parts)), want)
    for cut in (jax.jit(unpack, static_argnums=1)(flat, tuple(sizes)), unpack_reference(flat, sizes)):
        assert [p.shape for p in cut] == [(m,) for m in sizes] and all(p.dtype == dtype for p in cut)
        for got, part in zip(cut, parts):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(part))


def test_pack_and_unpack_vmap():
    rows = [jnp.arange(6.0).reshape(2, 3), jnp.arange(8.0).reshape(2, 4) + 100]
    flat = jax.vmap(lambda a, b: pack([a, b]))(*rows)
    np.testing.assert_array_equal(np.asarray(flat), np.concatenate([np.asarray(r) for r in rows], axis=1))
    a, b = jax.vmap(lambda f: tuple(unpack(f, [3, 4])))(flat)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(rows[0]))
    np.testing.assert_array_equal(np.asarray(b), np.asarray(rows[1]))


@settings(max_examples=20, deadline=None)  # each set of sizes compiles anew
@given(st.lists(st.integers(0, 9000), min_size=1, max_size=5).flatmap(
    lambda sizes: st.tuples(st.just(sizes), st.floats(0.0, 1.0), st.integers(0, 2**16))))
def test_to_dense_parts_matches_numpy_and_reference(case):
    # Pieces of every length, empty ones included, whose supports cross the kernel's 4096-entry
    # blocks and the pieces' own bounds, from empty to every entry (the dense form).
    sizes, density, seed = case
    size = sum(sizes)
    rng = np.random.default_rng(seed)
    s = random_stream(rng, size, int(density * size), capacity=size + 2)
    want = np.split(np_dense_of(s), np.cumsum(sizes)[:-1])
    for got in (jax.jit(to_dense_parts, static_argnums=1)(s, tuple(sizes)), to_dense_parts_reference(s, sizes)):
        assert [p.shape for p in got] == [(m,) for m in sizes]
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g), w)


def test_to_dense_parts_of_dense_streams():
    x = np.arange(1, 8, dtype=np.float32)
    for s in (dense_stream(x), dense_stream(x, capacity=9), SparseStream.dense(jnp.asarray(x))):
        a, b = to_dense_parts(s, [3, 4])
        np.testing.assert_array_equal(np.asarray(a), x[:3])
        np.testing.assert_array_equal(np.asarray(b), x[3:])


def test_pack_unpack_and_to_dense_parts_static_errors():
    with pytest.raises(TypeError, match=r"pack: parts\[1\] has dtype bfloat16, parts\[0\] float32; convert"):
        pack([jnp.zeros(2), jnp.zeros(2, jnp.bfloat16)])
    with pytest.raises(ValueError, match=r"pack: parts\[0\] must be a 1-D vector, got shape \(2, 2\); flatten"):
        pack([jnp.zeros((2, 2))])
    with pytest.raises(ValueError, match="pack: parts is empty"):
        pack([])
    with pytest.raises(ValueError, match=r"unpack: flat must be a vector of sum\(sizes\) = 4 entries, got shape \(5,\)"):
        unpack(jnp.zeros(5), [1, 3])
    with pytest.raises(ValueError, match="sizes must be non-negative static ints"):
        unpack(jnp.zeros(2), [3, -1])
    with pytest.raises(ValueError, match="to_dense_parts: sizes sum to 9, but the stream describes a vector of 10"):
        to_dense_parts(make_stream([1], [1.0], 10), [4, 5])


# ------------------------------------------------------------------ run-time stream validation


def _bad_streams():
    good = make_stream([1, 4, 7], [1.0, 2.0, 3.0], 10, capacity=5)
    return [
        (SparseStream(good.indices.at[1].set(1), good.values, good.nnz, 10), "stream: indices must be strictly increasing"),
        (SparseStream(good.indices.at[2].set(3), good.values, good.nnz, 10), "stream: indices must be strictly increasing"),
        (SparseStream(good.indices.at[2].set(10), good.values, good.nnz, 10), r"stream: indices must lie in \[0, n=10\)"),
        (SparseStream(good.indices.at[0].set(-1), good.values, good.nnz, 10), r"stream: indices must lie in \[0, n=10\); found -1"),
        (SparseStream(good.indices, good.values, jnp.int32(6), 10), r"stream: nnz=6 exceeds its capacity 5"),
        (SparseStream(good.indices, good.values, jnp.int32(-1), 10), r"stream: nnz=-1 is negative"),
        # No index array but a count below the size (with indices made up, they lie out of range).
        (SparseStream(jnp.zeros((0,), jnp.int32), jnp.ones(10), jnp.int32(3), 10),
         r"stream: (a stream without indices is dense: its nnz must be its size 10, got 3|indices must lie in "
         r"\[0, n=10\))"),
    ]


@pytest.mark.parametrize("case", range(7))
def test_bad_streams_raise_at_run_time(case):
    bad, match = _bad_streams()[case]
    with pytest.raises(ERRORS, match=match):
        scatter_add(bad, jnp.zeros(10)).block_until_ready()
    with pytest.raises(ERRORS, match=match):
        bad.to_dense().block_until_ready()
    with pytest.raises(ERRORS, match=match):
        jax.jit(scatter_add)(bad, jnp.zeros(10)).block_until_ready()
    if not bad.dense_by_construction:  # (whose traced count to_dense trusts: it returns the values)
        with pytest.raises(ERRORS, match=match):
            jax.jit(to_dense)(bad).block_until_ready()
    for _ in range(2):
        with pytest.raises(ERRORS, match=match):
            jax.jit(split, static_argnums=1)(bad, 3).block_until_ready()
    if not bad.dense_by_construction:
        with pytest.raises(ERRORS, match=match):
            jax.block_until_ready(jax.jit(to_dense_parts, static_argnums=1)(bad, (4, 0, 6)))


@pytest.mark.parametrize("indices,nnz,match", [
    ([2, 2, 5], 3, "indices: indices must be strictly increasing"),
    ([3, 1, 5], 2, "indices: indices must be strictly increasing"),
    ([2, 5, 10], 3, r"indices: indices must lie in \[0, n=10\)"),
    ([-3, 5, 9], 3, r"indices: indices must (lie in|be strictly)"),
    ([1, 2, 3], 4, r"indices: nnz=4 exceeds its capacity 3"),
])
def test_gather_bad_indices_raise_at_run_time(indices, nnz, match):
    with pytest.raises(ERRORS, match=match):
        gather(jnp.zeros(10), jnp.asarray(indices, jnp.int32), nnz).values.block_until_ready()


# ------------------------------------------------------------------ docstrings


def test_docstring_examples():
    result = doctest.testmod(partition)
    assert result.attempted > 0 and result.failed == 0
