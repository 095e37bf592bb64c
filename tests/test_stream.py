"""SparseStream: dense round trips, the dense switch, pytree behaviour, constructor checks."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparcml_jax import SparseStream, dense_threshold
from sparcml_jax.kernels.partition import partition_bounds, split
from sparcml_jax.stream import append_dense

ERRORS = (ValueError, RuntimeError)


def with_nonzeros(size, count, value=1.5):
    x = np.zeros(size, np.float32)
    x[np.linspace(0, size - 1, count).astype(int) if count else []] = value
    assert np.count_nonzero(x) == count
    return x


@functools.cache
def to_dense_jit():
    return jax.jit(SparseStream.to_dense)


@functools.cache
def from_dense_jit(capacity, delta=1.0):
    return jax.jit(functools.partial(SparseStream.from_dense, capacity=capacity, delta=delta))


# ------------------------------------------------------------------ round trips


@pytest.mark.parametrize("size,count,capacity", [(1, 0, None), (1, 1, None), (9, 2, None), (9, 2, 2), (9, 2, 5),
                                                 (64, 10, 16), (64, 40, None), (64, 40, 100), (64, 64, 64)])
def test_round_trip_matches_numpy(size, count, capacity):
    rng = np.random.default_rng(size + count)
    x = np.zeros(size, np.float32)
    x[rng.choice(size, count, replace=False)] = rng.normal(size=count).astype(np.float32)
    s = from_dense_jit(capacity)(x)
    assert s.size == size and s.capacity == (size if capacity is None else capacity)
    np.testing.assert_array_equal(np.asarray(to_dense_jit()(s)), x)
    n = int(s.nnz)
    if n != size:  # sparse form: the pairs are numpy's nonzeros, padding after them
        np.testing.assert_array_equal(np.asarray(s.indices)[:n], np.flatnonzero(x))
        np.testing.assert_array_equal(np.asarray(s.indices)[n:], size)
        np.testing.assert_array_equal(np.asarray(s.values)[n:], 0.0)


@pytest.mark.parametrize("size,count,capacity", [(9, 0, 3), (9, 2, 5), (64, 10, 16), (64, 40, None), (64, 64, 64),
                                                 (0, 0, 0)])
@pytest.mark.parametrize("m", [0, 1, 7])
def test_append_dense_matches_numpy_concatenate(size, count, capacity, m):
    """The appended entries follow the valid pairs, sorted, whatever the form of ``s``."""
    x = with_nonzeros(size, count, value=-2.5)
    tail = np.arange(1, m + 1, dtype=np.float32) * np.float32(0.5) - 1  # one entry is 0
    s = jax.jit(append_dense)(from_dense_jit(capacity)(x), tail)
    assert s.size == size + m and int(s.nnz) in (count + m, size + m)
    np.testing.assert_array_equal(np.asarray(to_dense_jit()(s)), np.concatenate([x, tail]))
    if int(s.nnz) != s.size:
        np.testing.assert_array_equal(np.diff(np.asarray(s.indices)[:int(s.nnz)]) > 0, True)
    whole = jax.jit(append_dense)(SparseStream.dense(jnp.asarray(x)), tail)
    assert whole.dense_by_construction
    np.testing.assert_array_equal(np.asarray(to_dense_jit()(whole)), np.concatenate([x, tail]))


def test_append_dense_keeps_an_invalid_stream_invalid():
    s = jax.jit(append_dense)(from_dense_jit(3)(with_nonzeros(10, 5)), jnp.ones(2))
    with pytest.raises(ERRORS, match="exceeds its capacity"):
        to_dense_jit()(s).block_until_ready()


def test_docstring_example_eager():
    s = SparseStream.from_dense(jnp.array([0.0, 3.0, 0.0, 0.0, 0.0, -1.0]), capacity=4)
    assert s.indices.tolist() == [1, 5, 6, 6] and s.values.tolist() == [3.0, -1.0, 0.0, 0.0] and int(s.nnz) == 2
    assert s.to_dense().tolist() == [0.0, 3.0, 0.0, 0.0, 0.0, -1.0]


@pytest.mark.parametrize("delta,threshold", [(1.0, 8), (0.5, 4)])
def test_dense_switch_exactly_at_threshold(delta, threshold):
    size = 16
    assert dense_threshold(size, delta) == threshold
    below = from_dense_jit(None, delta)(with_nonzeros(size, threshold - 1))
    at = from_dense_jit(None, delta)(with_nonzeros(size, threshold))
    assert int(below.nnz) == threshold - 1 and not bool(below.is_dense)
    assert int(at.nnz) == size and bool(at.is_dense)
    np.testing.assert_array_equal(np.asarray(at.indices), np.arange(size))
    np.testing.assert_array_equal(np.asarray(at.values), with_nonzeros(size, threshold))
    assert int(at.wire_bytes()) == size * 4 and int(below.wire_bytes()) == (threshold - 1) * 8
    # a capacity above size pads the dense form; a capacity below size never switches
    padded = from_dense_jit(size + 3, delta)(with_nonzeros(size, threshold))
    assert int(padded.nnz) == size
    np.testing.assert_array_equal(np.asarray(padded.indices), np.r_[np.arange(size), [size] * 3])
    sparse = from_dense_jit(size - 1, delta)(with_nonzeros(size, threshold))
    assert int(sparse.nnz) == threshold


def test_nan_and_inf_survive_and_negative_zero_is_zero():
    x = np.array([np.nan, 0.0, -0.0, np.inf, -np.inf, 0.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0], np.float32)
    for capacity in (None, 4, 20):
        s = from_dense_jit(capacity)(x)
        back = np.asarray(to_dense_jit()(s))
        np.testing.assert_array_equal(back, np.where(x == 0, 0.0, x))
        assert not np.signbit(back[2])
        assert int(s.nnz) == 4


def test_capacity_overflow_raises_where_the_stream_is_used():
    s = from_dense_jit(3)(with_nonzeros(10, 5))
    assert int(s.nnz) == 5
    with pytest.raises(ERRORS, match="nnz=5 exceeds its capacity 3"):
        to_dense_jit()(s).block_until_ready()


def test_empty_stream():
    s = SparseStream.empty(7, 3)
    assert int(s.nnz) == 0 and s.capacity == 3 and s.indices.tolist() == [7, 7, 7]
    np.testing.assert_array_equal(np.asarray(to_dense_jit()(s)), np.zeros(7))
    np.testing.assert_array_equal(np.asarray(split(s, 2)), [0, 0, 0])


# ------------------------------------------------------------------ pytree behaviour


def test_pytree_structure_and_tree_map():
    s = from_dense_jit(4)(with_nonzeros(10, 3))
    leaves, treedef = jax.tree.flatten(s)
    assert len(leaves) == 3  # size is static metadata, not a leaf
    rebuilt = jax.tree.unflatten(treedef, leaves)
    assert isinstance(rebuilt, SparseStream) and rebuilt.size == 10
    doubled = jax.tree.map(lambda leaf: leaf * 2 if leaf.dtype == jnp.float32 else leaf, s)
    assert isinstance(doubled, SparseStream) and doubled.size == 10
    np.testing.assert_array_equal(np.asarray(to_dense_jit()(doubled)), 2 * with_nonzeros(10, 3))
    # streams of different sizes have different tree structures
    other = from_dense_jit(4)(with_nonzeros(11, 3))
    assert jax.tree.structure(other) != treedef


def test_jit_takes_and_returns_streams():
    @jax.jit
    def scale(s):
        assert isinstance(s, SparseStream) and s.size == 10  # size stays a Python int under jit
        return SparseStream(s.indices, s.values * 3, s.nnz, s.size)

    s = from_dense_jit(4)(with_nonzeros(10, 3))
    out = scale(s)
    assert isinstance(out, SparseStream) and out.size == 10
    np.testing.assert_array_equal(np.asarray(to_dense_jit()(out)), 3 * with_nonzeros(10, 3))


def test_vmap_of_streams():
    xs = np.stack([with_nonzeros(20, k, float(k)) for k in (0, 2, 5, 20)])
    streams = jax.vmap(functools.partial(SparseStream.from_dense, capacity=20))(xs)
    assert streams.indices.shape == (4, 20) and streams.nnz.shape == (4,) and streams.size == 20
    np.testing.assert_array_equal(np.asarray(streams.nnz), [0, 2, 5, 20])
    np.testing.assert_array_equal(np.asarray(jax.vmap(SparseStream.to_dense)(streams)), xs)
    np.testing.assert_array_equal(np.asarray(jax.vmap(lambda s: s.is_dense)(streams)), [False, False, False, True])


@pytest.mark.parametrize("field,bad", [
    ("indices", jnp.zeros(3, jnp.float32)),
    ("values", jnp.zeros(3, jnp.int32)),
    ("nnz", jnp.float32(1)),
])
def test_constructor_rejects_wrong_dtypes(field, bad):
    parts = dict(indices=jnp.zeros(3, jnp.int32), values=jnp.zeros(3, jnp.float32), nnz=jnp.int32(0))
    parts[field] = bad
    with pytest.raises(TypeError, match=f"SparseStream.{field} must have dtype"):
        SparseStream(**parts, size=5)


# ------------------------------------------------------------------ properties

SIZES = (1, 2, 7, 16, 33)  # a few static sizes keep the number of compilations small
ENTRIES = st.sampled_from([0.0, 0.0, 0.0, 0.0, -0.0, 1.0, -2.5, 3e38, np.inf, np.nan])


@st.composite
def vector_and_capacity(draw):
    size = draw(st.sampled_from(SIZES))
    x = np.array(draw(st.lists(ENTRIES, min_size=size, max_size=size)), np.float32)
    count = int(np.count_nonzero(x))
    capacity = draw(st.sampled_from([None, size, count, size + 1, max(count, 1) * 2]))
    return x, capacity


@settings(max_examples=60, deadline=None, database=None)
@given(vector_and_capacity())
def test_from_dense_to_dense_identity(case):
    x, capacity = case
    s = from_dense_jit(capacity)(x)
    np.testing.assert_array_equal(np.asarray(to_dense_jit()(s)), np.where(x == 0, 0.0, x))
    count = int(np.count_nonzero(x))
    cap = x.size if capacity is None else capacity
    want_dense = cap >= x.size and count >= dense_threshold(x.size)
    assert int(s.nnz) == (x.size if want_dense else count)


@settings(max_examples=60, deadline=None, database=None)
@given(vector_and_capacity(), st.integers(1, 40))
def test_split_offsets_partition_the_pairs(case, parts):
    x, capacity = case
    s = from_dense_jit(capacity)(x)
    offsets = np.asarray(jax.jit(split, static_argnums=1)(s, parts))
    bounds = partition_bounds(x.size, parts)
    n = int(s.nnz)
    idx = np.asarray(s.indices)[:n]
    assert offsets[0] == 0 and offsets[-1] == n and np.all(np.diff(offsets) >= 0)
    np.testing.assert_array_equal(offsets, np.searchsorted(idx, bounds, side="left"))
    if n == x.size:
        np.testing.assert_array_equal(offsets, bounds)
