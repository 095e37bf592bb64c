import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparcml_jax import SparseStream, dense_threshold, from_dense, merge, merge_reference

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


@pytest.mark.parametrize("dense_input", [False, True])
def test_capacity_overflow_gives_a_stream_every_consumer_rejects(dense_input):
    """The first ``capacity`` pairs of the sum and the true count, as the reference; raising here
    would stop one rank before a collective its peers wait in."""
    rng = np.random.default_rng(4)
    a, b = random_stream(rng, 1000, 10), random_stream(rng, 1000, 10)
    if dense_input:
        a = from_dense(np.asarray(a.to_dense()) + 1.0)
    union = 1000 if dense_input else np.union1d(np.asarray(a.indices)[:10], np.asarray(b.indices)[:10]).size
    out = merge(a, b, capacity=5)
    assert int(out.nnz) == union
    assert_same_stream(out, merge_reference(a, b, capacity=5))
    want = np.asarray(a.to_dense()) + np.asarray(b.to_dense())
    support = np.flatnonzero(want) if not dense_input else np.arange(1000)
    np.testing.assert_array_equal(np.asarray(out.indices), support[:5])
    np.testing.assert_array_equal(np.asarray(out.values), want[support[:5]])
    with pytest.raises(ERRORS, match=f"nnz={union} exceeds its capacity 5"):
        out.to_dense().block_until_ready()


def test_mismatched_sizes_raise():
    rng = np.random.default_rng(5)
    with pytest.raises(ValueError, match="different sizes"):
        merge(random_stream(rng, 10, 2), random_stream(rng, 11, 2))


# ------------------------------------------------ long streams: the vectorized merge (AVX-512)
# It merges tiles of 2048 pairs cut into 4 interleaved pieces, and emits an index present in both
# inputs once: these cases put such twins at every kind of boundary, and compare bit for bit.


def stream_of(idx, val, size, capacity=None):
    capacity = len(idx) if capacity is None else capacity
    pad = capacity - len(idx)
    return SparseStream(
        jnp.asarray(np.concatenate([idx, np.full(pad, size, np.int32)]).astype(np.int32)),
        jnp.asarray(np.concatenate([val, np.zeros(pad, np.float32)]).astype(np.float32)),
        jnp.int32(len(idx)),
        size,
    )


def float_values(rng, idx, other_idx):
    """Finite float32 bit patterns of every magnitude with signed zeros. XLA:CPU flushes subnormal
    operands and results of a sum to zero, so subnormals go only where the other input lacks the
    index, and summands are 0 or at least 2**-100 (their sum is then 0 or normal)."""
    n, twin = len(idx), np.isin(idx, other_idx)
    bits = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    bits[bits & 0x7F800000 == 0x7F800000] &= 0xBFFFFFFF  # no inf / NaN
    bits[(rng.random(n) < 0.05) & ~twin] &= 0x800000FF  # subnormals
    bits[((bits >> 23) & 0xFF < 27) & twin] &= 0x80000000  # tiny summands: +-0
    bits[rng.random(n) < 0.05] &= 0x80000000  # +-0
    return bits.view(np.float32)


def union_oracle(a_idx, a_val, b_idx, b_val):
    """The sorted union, a + b (float32, a first) where both have the index."""
    idx = np.union1d(a_idx, b_idx).astype(np.int32)
    val = np.zeros(len(idx), np.float32)
    ia, ib = np.searchsorted(idx, a_idx), np.searchsorted(idx, b_idx)
    val[ia] = a_val
    twin = np.isin(b_idx, a_idx)
    val[ib[~twin]] = b_val[~twin]
    with np.errstate(over="ignore"):  # a sum may round to +-inf, as in C
        val[ib[twin]] = val[ib[twin]] + b_val[twin]
    return idx, val


def supports(kind, rng):
    size = 1 << 20
    pick = lambda n: np.sort(rng.choice(size, n, replace=False)).astype(np.int32)
    if kind == "random":
        return size, pick(60_000), pick(60_000)
    if kind == "overlapping":  # b: half of a's indices and as many others
        a = pick(50_000)
        return size, a, np.union1d(a[rng.random(len(a)) < 0.5], pick(25_000)).astype(np.int32)
    if kind == "identical":
        a = pick(40_000)
        return size, a, a.copy()
    if kind == "interleaved":  # strict alternation, no twins
        return size, np.arange(0, 80_000, 2, dtype=np.int32), np.arange(1, 80_000, 2, dtype=np.int32)
    if kind == "a_below_b":
        return size, np.arange(30_000, dtype=np.int32), np.arange(30_000, 60_000, dtype=np.int32)
    if kind == "tiny_a":
        return size, pick(3), pick(70_000)
    if kind == "tiny_b":
        return size, pick(70_000), pick(1)
    if kind == "empty_a":
        return size, np.zeros(0, np.int32), pick(50_000)
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["random", "overlapping", "identical", "interleaved", "a_below_b", "tiny_a",
                                  "tiny_b", "empty_a"])
def test_long_merge_is_exact(kind):
    rng = np.random.default_rng([ord(c) for c in kind])
    size, a_idx, b_idx = supports(kind, rng)
    a_val, b_val = float_values(rng, a_idx, b_idx), float_values(rng, b_idx, a_idx)
    idx, val = union_oracle(a_idx, a_val, b_idx, b_val)
    for capacity in (None, len(idx)):  # default (room for both) and exactly the union
        out = merge(stream_of(a_idx, a_val, size), stream_of(b_idx, b_val, size), capacity=capacity)
        n = int(out.nnz)
        assert n == len(idx)
        np.testing.assert_array_equal(np.asarray(out.indices)[:n], idx)
        np.testing.assert_array_equal(np.asarray(out.values)[:n].view(np.uint32), val.view(np.uint32))
        assert (np.asarray(out.indices)[n:] == size).all() and (np.asarray(out.values)[n:] == 0).all()


@pytest.mark.parametrize("short", [1, 17, 5000])
def test_long_merge_overflow_keeps_the_first_pairs_and_the_true_count(short):
    """The vectorized merge stops storing at the capacity (inside a tile or at its end) and counts on."""
    rng = np.random.default_rng(6)
    size, a_idx, b_idx = supports("overlapping", rng)
    union = len(np.union1d(a_idx, b_idx))
    a, b = stream_of(a_idx, float_values(rng, a_idx, b_idx), size), stream_of(b_idx, float_values(rng, b_idx, a_idx), size)
    full = merge(a, b, capacity=union)
    out = merge(a, b, capacity=union - short)
    assert int(out.nnz) == union
    np.testing.assert_array_equal(np.asarray(out.indices), np.asarray(full.indices)[:union - short])
    np.testing.assert_array_equal(np.asarray(out.values).view(np.uint32),
                                  np.asarray(full.values)[:union - short].view(np.uint32))


@pytest.mark.parametrize("which,corrupt,match", [
    ("a", lambda x: x.__setitem__(40_000, x[39_999]), "a: .*strictly increasing.*position 40000"),
    ("b", lambda x: x.__setitem__(33_333, x[33_332] - 1), "b: .*strictly increasing.*position 33333"),
    ("b", lambda x: x.__setitem__(slice(2047, 2049), x[2047:2049][::-1]), "b: .*strictly increasing.*position 2048"),
    ("a", lambda x: x.__setitem__(-1, 1 << 20), r"a: indices must lie in \[0, n=1048576\)"),
])
def test_long_bad_stream_raises_like_the_checks(which, corrupt, match):
    rng = np.random.default_rng(7)
    size, a_idx, b_idx = supports("random", rng)
    corrupt(a_idx if which == "a" else b_idx)
    a, b = stream_of(a_idx, float_values(rng, a_idx, b_idx), size), stream_of(b_idx, float_values(rng, b_idx, a_idx), size)
    with pytest.raises(ERRORS, match=match):
        merge(a, b).nnz.block_until_ready()
