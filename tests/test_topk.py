import doctest

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sparcml_jax.kernels.topk as topk_module
from sparcml_jax.kernels.topk import topk, topk_reference

NAN, INF = np.float32(np.nan), np.float32(np.inf)

topk_jit = jax.jit(topk, static_argnums=1)
reference_jit = jax.jit(topk_reference, static_argnums=1)


def oracle(x, k):
    """Independent numpy top-k: order by (-key, index), keep k, sort by index."""
    x = np.asarray(x, np.float32)
    key = (x.view(np.uint32) & np.uint32(0x7FFFFFFF)).astype(np.int64)
    order = np.lexsort((np.arange(x.size), -key))
    chosen = np.sort(order[:k]).astype(np.int32)
    return chosen, x[chosen]


def bits(a):
    return np.asarray(a, np.float32).view(np.uint32)


def assert_matches_oracle(s, x, k):
    want_idx, want_val = oracle(x, k)
    assert s.size == len(x) and s.capacity == k and int(s.nnz) == k
    assert s.indices.dtype == jnp.int32 and s.values.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(s.indices), want_idx)
    np.testing.assert_array_equal(bits(s.values), bits(want_val))  # bitwise: NaN payloads, -0.0


def random_vector(rng, n, kind):
    if kind == "normal":
        return rng.standard_normal(n).astype(np.float32)
    if kind == "duplicates":  # few distinct magnitudes, both signs, zeros
        return rng.integers(-3, 4, n).astype(np.float32)
    if kind == "sparse":  # an already-sparse gradient: 99 % exact zeros
        return np.where(rng.random(n) < 0.01, rng.standard_normal(n), 0.0).astype(np.float32)
    if kind == "close":  # many keys sharing their top 16 bits, differing in the low ones
        x = (1.0 + rng.integers(0, 64, n) * np.float32(2**-23)).astype(np.float32)
        return np.where(rng.random(n) < 0.5, -x, x)
    if kind == "bfloat16":  # upcast bf16 gradients: the low 16 key bits are all zero
        return np.asarray(jnp.asarray(rng.standard_normal(n), jnp.bfloat16).astype(jnp.float32))
    if kind == "special":
        pool = np.array([0.0, -0.0, 1.0, -1.0, INF, -INF, NAN, 2.5, 1e-45, -3e38], np.float32)
        return pool[rng.integers(0, pool.size, n)]
    raise ValueError(kind)


KINDS = ["normal", "duplicates", "sparse", "close", "bfloat16", "special"]


# Sizes straddle the kernel's internal regimes (small-n radix, sampled floor, full histogram when
# the sample cannot help).
# (Small n, k = 0 and k = n are covered by the property test and the edge-case tests below.)
@pytest.mark.parametrize("n", [1000, 8192, 37376, 70001, 300000])
@pytest.mark.parametrize("kind", KINDS)
def test_matches_oracle_and_reference(n, kind):
    rng = np.random.default_rng(n * 31 + KINDS.index(kind))
    x = random_vector(rng, n, kind)
    for k in sorted({1, max(1, n // 1000), n // 100, n // 2, n - 1}):
        s = topk_jit(jnp.asarray(x), k)
        assert_matches_oracle(s, x, k)
        r = reference_jit(jnp.asarray(x), k)
        np.testing.assert_array_equal(np.asarray(r.indices), np.asarray(s.indices))
        np.testing.assert_array_equal(bits(r.values), bits(s.values))


def _sample_positions(n):
    # The chunks topk.c samples (16 entries per 512 at hashed offsets) to guess its floor.
    chunks = np.arange(n // 512, dtype=np.uint64)
    slot = ((chunks * np.uint64(2654435761)) & np.uint64(0xFFFFFFFF)) >> np.uint64(27)
    start = chunks * np.uint64(512) + slot * np.uint64(16)
    return (start[:, None] + np.arange(16, dtype=np.uint64)).ravel().astype(np.int64)


@pytest.mark.parametrize("n", [1 << 13, 37376, 1 << 18])
@pytest.mark.parametrize("layout", ["sample_overestimates", "sample_underestimates", "periodic", "clustered"])
def test_structured_inputs_defeating_the_sample_stay_exact(layout, n):
    # Adversarial layouts for the kernel's sampled guess: the guess can only cost time.
    rng = np.random.default_rng(7)
    x = rng.random(n, dtype=np.float32)
    if layout == "sample_overestimates":  # big values only where the kernel looks
        x[_sample_positions(n)] = 50 + rng.random(_sample_positions(n).size, dtype=np.float32)
    elif layout == "sample_underestimates":  # big values everywhere the kernel does not look
        x = 60 + rng.random(n, dtype=np.float32)
        x[_sample_positions(n)] = rng.random(_sample_positions(n).size, dtype=np.float32)
    elif layout == "periodic":  # a (rows, 512) weight whose first 16 columns dominate
        x[(np.arange(n) % 512) < 16] += 100
    else:  # one layer with far larger gradients than the rest
        x[1000:3000] *= 1000
    for k in (n // 1000, n // 100, n // 10):
        assert_matches_oracle(topk_jit(jnp.asarray(x), k), x, k)


def test_runs_the_c_kernel_on_cpu():
    text = jax.jit(lambda v: topk(v, 3)).lower(jnp.zeros(10, jnp.float32)).as_text()
    assert "sparcml_topk" in text


def test_vmap():
    rng = np.random.default_rng(1)
    xs = np.stack([random_vector(rng, 20000, kind) for kind in KINDS])
    for k in (0, 1, 150, 20000):
        out = jax.jit(jax.vmap(lambda v: topk(v, k)))(jnp.asarray(xs))
        assert out.indices.shape == (len(KINDS), k) and out.size == 20000
        for row, x in enumerate(xs):
            want_idx, want_val = oracle(x, k)
            np.testing.assert_array_equal(np.asarray(out.indices[row]), want_idx)
            np.testing.assert_array_equal(bits(out.values[row]), bits(want_val))
        ref = jax.vmap(lambda v: topk_reference(v, k))(jnp.asarray(xs))
        np.testing.assert_array_equal(np.asarray(ref.indices), np.asarray(out.indices))
    # Batch axis not in front, and nested vmaps: one kernel call over all rows either way.
    out = jax.vmap(jax.vmap(lambda v: topk(v, 30), in_axes=1), in_axes=2)(jnp.asarray(xs.T[:, :, None]))
    for row, x in enumerate(xs):
        np.testing.assert_array_equal(np.asarray(out.indices[0, row]), oracle(x, 30)[0])


def test_empty_vector():
    for f in (topk, topk_reference):
        s = f(jnp.zeros((0,), jnp.float32), 0)
        assert s.size == 0 and s.capacity == 0 and int(s.nnz) == 0
    s = jax.vmap(lambda v: topk(v, 0))(jnp.zeros((3, 0), jnp.float32))
    assert s.indices.shape == (3, 0)


def test_k_zero_and_k_n_is_the_dense_representation():
    x = jnp.asarray([3.0, -1.0, 0.0, -0.0, 7.0], jnp.float32)
    empty = topk(x, 0)
    assert empty.indices.shape == (0,) and int(empty.nnz) == 0
    np.testing.assert_array_equal(np.asarray(empty.to_dense()), np.zeros(5, np.float32))
    full = topk(x, 5)
    assert bool(full.is_dense)
    np.testing.assert_array_equal(np.asarray(full.indices), np.arange(5))
    np.testing.assert_array_equal(bits(full.values), bits(x))


def test_single_entry():
    for v in (-2.0, 0.0, float("nan")):
        s = topk(jnp.asarray([v], jnp.float32), 1)
        assert np.asarray(s.indices).tolist() == [0]
        np.testing.assert_array_equal(bits(s.values), bits([v]))
        assert topk(jnp.asarray([v], jnp.float32), 0).capacity == 0


@pytest.mark.parametrize("n", [10, 9000, 100000])
def test_equal_magnitudes_take_the_lowest_indices(n):
    x = np.where(np.arange(n) % 2 == 0, 1.5, -1.5).astype(np.float32)
    for k in (1, 3, n // 2):
        s = topk_jit(jnp.asarray(x), k)
        np.testing.assert_array_equal(np.asarray(s.indices), np.arange(k))
        np.testing.assert_array_equal(np.asarray(s.values), x[:k])


def test_mixed_signs_keep_their_sign():
    x = jnp.asarray([1.0, -5.0, 2.0, -4.0, 3.0, 0.5], jnp.float32)
    s = topk(x, 3)
    assert np.asarray(s.indices).tolist() == [1, 3, 4]
    assert np.asarray(s.values).tolist() == [-5.0, -4.0, 3.0]


def test_nan_ranks_above_inf_and_inf_above_finite():
    x = np.array([1.0, NAN, -INF, 3e38, INF, -NAN, 0.0], np.float32)
    # NaN (either sign) is selected first: a NaN gradient is sent, not hidden in the residual.
    assert np.asarray(topk(jnp.asarray(x), 1).indices).tolist() == [1]
    assert np.asarray(topk(jnp.asarray(x), 2).indices).tolist() == [1, 5]
    s = topk(jnp.asarray(x), 4)  # then -inf and inf tie: lower index first
    assert np.asarray(s.indices).tolist() == [1, 2, 4, 5]
    np.testing.assert_array_equal(bits(s.values), bits(x[[1, 2, 4, 5]]))
    assert np.asarray(topk(jnp.asarray(x), 5).indices).tolist() == [1, 2, 3, 4, 5]


def test_negative_zero_ties_with_zero_and_keeps_its_bits():
    x = np.array([-0.0, 0.0, -0.0, 0.0], np.float32)
    s = topk(jnp.asarray(x), 3)
    assert np.asarray(s.indices).tolist() == [0, 1, 2]
    np.testing.assert_array_equal(bits(s.values), bits(x[:3]))


def test_selected_plus_residual_is_the_input():
    # Error feedback's invariant for one step: sent + kept == gradient, bit for bit.
    x = np.random.default_rng(3).standard_normal(50000).astype(np.float32)
    s = topk_jit(jnp.asarray(x), 500)
    sent = np.asarray(s.to_dense())
    residual = np.where(sent != 0, 0, x)
    np.testing.assert_array_equal(sent + residual, x)
    assert np.abs(residual).max() <= np.abs(np.asarray(s.values)).min()


@pytest.mark.parametrize("f", [topk, topk_reference])
def test_bad_arguments_name_the_argument(f):
    x = jnp.ones(10, jnp.float32)
    with pytest.raises(ValueError, match=r"x must be a 1-D vector.*ravel"):
        f(jnp.ones((2, 5), jnp.float32), 1)
    with pytest.raises(TypeError, match=r"x must have dtype float32, got int32"):
        f(jnp.ones(10, jnp.int32), 1)
    with pytest.raises(TypeError, match=r"x must have dtype float32, got bfloat16"):
        f(jnp.ones(10, jnp.bfloat16), 1)
    with pytest.raises(ValueError, match=r"k=11 must lie in \[0, len\(x\)=10\]"):
        f(x, 11)
    with pytest.raises(ValueError, match=r"k=-1 must lie in \[0, len\(x\)=10\]"):
        f(x, -1)
    for bad in (2.0, True, None, jnp.int32(2)):
        with pytest.raises(TypeError, match=r"k must be a static Python int"):
            f(x, bad)
    with pytest.raises(TypeError, match=r"k must be a static Python int.*static_argnums"):
        jax.jit(f)(x, 2)
    assert f(x, np.int64(2)).capacity == 2  # numpy integers are fine


def test_length_must_fit_int32_indices():
    with pytest.raises(ValueError, match=r"len\(x\)=2147483648 does not fit int32"):
        jax.eval_shape(lambda: topk(jnp.zeros(2**31, jnp.float32), 1))


_POOL = [0.0, -0.0, 1.0, -1.0, 2.0, -2.0, 0.5, 1e-45, -1e-45, 3e38, float("inf"), float("-inf"), float("nan")]
_values = st.one_of(
    st.sampled_from(_POOL),
    st.floats(width=32, allow_nan=True, allow_infinity=True),
)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_property_random_small_vectors(data):
    n = data.draw(st.integers(0, 24), label="n")
    x = np.array(data.draw(st.lists(_values, min_size=n, max_size=n), label="x"), np.float32)
    k = data.draw(st.integers(0, n), label="k")
    s = topk_jit(jnp.asarray(x), k)
    assert_matches_oracle(s, x, k)
    r = reference_jit(jnp.asarray(x), k)
    np.testing.assert_array_equal(np.asarray(r.indices), np.asarray(s.indices))
    indices = np.asarray(s.indices)
    assert np.all(np.diff(indices) > 0)
    # Every unselected magnitude is <= every selected one (key order).
    key = (x.view(np.uint32) & np.uint32(0x7FFFFFFF)).astype(np.int64)
    rest = np.setdiff1d(np.arange(n), indices)
    if k and rest.size:
        assert key[rest].max() <= key[indices].min()


def test_docstring_examples():
    result = doctest.testmod(topk_module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
