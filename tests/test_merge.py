import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparcml_jax import SparseStream, dense_threshold, merge, merge_reference

ERRORS = (ValueError, RuntimeError)


def random_stream(rng, size, nnz, capacity=None):
    capacity = nnz if capacity is None else capacity
    idx = np.sort(rng.choice(size, nnz, replace=False)).astype(np.int32)
    val = rng.integers(-50, 50, nnz).astype(np.float32)
    pad = capacity - nnz
    return SparseStream(
        jnp.asarray(np.concatenate([idx, np.full(pad, size, np.int32)])),
        jnp.asarray(np.concatenate([val, np.zeros(pad, np.float32)])),
        jnp.int32(nnz),
        size,
    )


def dense_of(s):
    out = np.zeros(s.size, np.float32)
    n = int(s.nnz)
    np.add.at(out, np.asarray(s.indices)[:n], np.asarray(s.values)[:n])
    return out


def assert_same_stream(x, y):
    assert int(x.nnz) == int(y.nnz)
    np.testing.assert_array_equal(np.asarray(x.indices), np.asarray(y.indices))
    np.testing.assert_array_equal(np.asarray(x.values), np.asarray(y.values))


@pytest.mark.parametrize("size,na,nb", [(1, 0, 0), (1, 1, 0), (1, 1, 1), (10, 0, 3), (10, 3, 0), (100, 7, 9),
                                        (100, 40, 45), (1000, 1, 999), (64, 32, 32), (5, 5, 2)])
def test_merge_matches_numpy_and_reference(size, na, nb):
    rng = np.random.default_rng(size * 1000 + na * 10 + nb)
    a, b = random_stream(rng, size, na), random_stream(rng, size, nb)
    out = jax.jit(merge)(a, b)
    np.testing.assert_array_equal(np.asarray(out.to_dense()), dense_of(a) + dense_of(b))
    assert_same_stream(out, merge_reference(a, b))
    union = len(set(np.asarray(a.indices)[:na]) | set(np.asarray(b.indices)[:nb]))
    want_dense = out.capacity >= size and union >= dense_threshold(size)
    assert int(out.nnz) == (size if want_dense else union)


def test_switch_is_decided_on_actual_count():
    size = 100
    a = random_stream(np.random.default_rng(0), size, 30)
    out = merge(a, a)  # capacity allows dense, but the identical supports stay at 30 pairs
    assert out.capacity == size and int(out.nnz) == 30


def test_dense_inputs():
    rng = np.random.default_rng(1)
    x = rng.integers(-5, 5, 50).astype(np.float32)
    d = SparseStream(jnp.arange(50, dtype=jnp.int32), jnp.asarray(x), jnp.int32(50), 50)
    s = random_stream(rng, 50, 4)
    for a, b in [(d, s), (s, d), (d, d)]:
        out = merge(a, b)
        assert int(out.nnz) == 50
        np.testing.assert_array_equal(np.asarray(out.values), dense_of(a) + dense_of(b))
        assert_same_stream(out, merge_reference(a, b))


def test_merge_under_vmap():
    rng = np.random.default_rng(2)
    pairs = [(random_stream(rng, 40, 5), random_stream(rng, 40, 6)) for _ in range(3)]
    stack = lambda ss: jax.tree.map(lambda *l: jnp.stack(l), *ss)
    out = jax.vmap(merge)(stack([p[0] for p in pairs]), stack([p[1] for p in pairs]))
    for i, (a, b) in enumerate(pairs):
        np.testing.assert_array_equal(np.asarray(out.values[i]), np.asarray(merge(a, b).values))


@pytest.mark.parametrize("bad,match", [
    (lambda s: SparseStream(s.indices.at[1].set(s.indices[0]), s.values, s.nnz, s.size), "strictly increasing"),
    (lambda s: SparseStream(s.indices.at[s.nnz - 1].set(s.size + 3), s.values, s.nnz, s.size), r"\[0, n=100\)"),
    (lambda s: SparseStream(s.indices, s.values, jnp.int32(s.capacity + 1), s.size), "capacity"),
])
def test_bad_streams_raise_naming_argument(bad, match):
    a = random_stream(np.random.default_rng(3), 100, 5, capacity=8)
    with pytest.raises(ERRORS, match=match) as info:
        merge(bad(a), a).nnz.block_until_ready()
    assert "a:" in str(info.value)


def test_capacity_overflow_raises():
    rng = np.random.default_rng(4)
    a, b = random_stream(rng, 1000, 10), random_stream(rng, 1000, 10)
    with pytest.raises(ERRORS, match="exceeds out_capacity"):
        merge(a, b, capacity=5).nnz.block_until_ready()


def test_mismatched_sizes_raise():
    rng = np.random.default_rng(5)
    with pytest.raises(ValueError, match="different sizes"):
        merge(random_stream(rng, 10, 2), random_stream(rng, 11, 2))
