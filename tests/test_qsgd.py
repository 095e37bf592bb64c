import doctest

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparcml_jax import _lib
from sparcml_jax.kernels import qsgd as qsgd_module
from sparcml_jax.kernels.qsgd import (
    QuantizedVector,
    qsgd_dequantize,
    qsgd_dequantize_reference,
    qsgd_levels,
    qsgd_num_buckets,
    qsgd_packed_bytes,
    qsgd_quantize,
    qsgd_quantize_reference,
    qsgd_wire_bytes,
)

ERRORS = (ValueError, RuntimeError)
BITS = (2, 4, 8)
SCALES = ("max", "l2")


def bits_of(a):
    return np.asarray(a, np.float32).view(np.uint32)


def assert_bit_equal(a, b):
    np.testing.assert_array_equal(bits_of(a), bits_of(b))


def assert_same_quantized(q, r):
    assert (q.size, q.bits, q.bucket_size, q.scale) == (r.size, r.bits, r.bucket_size, r.scale)
    np.testing.assert_array_equal(np.asarray(q.data), np.asarray(r.data))
    assert_bit_equal(q.scales, r.scales)


def numpy_decode(data, scales, size, bits, bucket_size):
    """Independent decoder of the packed format (see the module docstring)."""
    data = np.asarray(data)
    L, per_byte = 2 ** (bits - 1) - 1, 8 // bits
    i = np.arange(size)
    codes = (data[i // per_byte].astype(np.int64) >> ((i % per_byte) * bits)) & (2**bits - 1)
    scale = np.asarray(scales, np.float64)[i // bucket_size]
    out = (codes - L) / L * scale
    return np.where(np.isfinite(scale), out, np.nan), codes


def both(x, key, **kw):
    """Quantizes and decodes with the C kernels and with the references (each in one jit), checks
    that both agree bit for bit, and returns the C (quantized, decoded)."""
    c = jax.jit(lambda x, k: (q := qsgd_quantize(x, k, **kw), qsgd_dequantize(q)))(x, key)
    r = jax.jit(lambda x, k: (q := qsgd_quantize_reference(x, k, **kw), qsgd_dequantize_reference(q)))(x, key)
    assert_same_quantized(c[0], r[0])
    assert_bit_equal(c[1], r[1])
    return c


def sample(rng, n, zeros=0.1):
    x = rng.standard_normal(n).astype(np.float32)
    x[rng.random(n) < zeros] = 0.0
    return jnp.asarray(x)


# Short last buckets (of length 1 too), codes straddling bucket boundaries inside a byte, and
# buckets longer than the kernel's 4096-code staging chunk.
CASES = [(7, 3), (5000, 333), (10001, 4999)]


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("n,bucket_size", CASES)
def test_c_matches_reference_bit_exact(bits, scale, n, bucket_size):
    x = sample(np.random.default_rng(n + bits), n)
    key = jax.random.key(n * 10 + bits)
    kw = dict(bits=bits, bucket_size=bucket_size, scale=scale)
    q, out = both(x, key, **kw)
    assert q.data.shape == (qsgd_packed_bytes(n, bits),) and q.data.dtype == jnp.uint8
    assert q.scales.shape == (qsgd_num_buckets(n, bucket_size),) and q.scales.dtype == jnp.float32
    assert out.shape == (n,) and out.dtype == jnp.float32
    # Each value lands on one of the two levels around it: |Q(v) - v| < scale / L, same sign.
    s = np.repeat(np.asarray(q.scales), bucket_size)[:n]
    xn, on = np.asarray(x), np.asarray(out)
    assert np.all(np.abs(on - xn) <= s / qsgd_levels(bits) * (1 + 1e-6))
    assert np.all(on * xn >= 0)


@pytest.mark.parametrize("scale", SCALES)
def test_threaded_chunks_match_reference(scale):
    # Long vectors are split into bucket- and byte-aligned chunks on XLA's thread pool (chunks of
    # at least 2**16 values; lcm(333, 4) = 1332 here), also per row under vmap.
    kw = dict(bits=2, bucket_size=333, scale=scale)
    x = sample(np.random.default_rng(9), 200_001)
    both(x, jax.random.key(9), **kw)
    xs, keys = x[:200_000].reshape(2, 100_000), jax.random.split(jax.random.key(10), 2)
    c = jax.jit(jax.vmap(lambda x, k: (q := qsgd_quantize(x, k, **kw), qsgd_dequantize(q))))(xs, keys)
    r = jax.jit(jax.vmap(lambda x, k: (q := qsgd_quantize_reference(x, k, **kw), qsgd_dequantize_reference(q))))(xs, keys)
    assert_same_quantized(c[0], r[0])
    assert_bit_equal(c[1], r[1])


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("scale", SCALES)
def test_dequantize_matches_numpy_decoder(bits, scale):
    n, bucket_size = 3001, 100
    x = sample(np.random.default_rng(bits), n)
    x = x.at[200:300].set(0.0).at[1005].set(jnp.nan)  # a zero bucket and a NaN bucket
    q = qsgd_quantize(x, jax.random.key(7), bits=bits, bucket_size=bucket_size, scale=scale)
    want, codes = numpy_decode(q.data, q.scales, n, bits, bucket_size)
    L = qsgd_levels(bits)
    assert codes.min() >= 0 and codes.max() <= 2 * L
    if (n * bits) % 8:  # unused high bits of the last byte are zero
        assert int(q.data[-1]) >> ((n * bits) % 8) == 0
    got = np.asarray(qsgd_dequantize(q))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0, equal_nan=True)
    assert np.all(codes[200:300] == L) and np.all(got[200:300] == 0)


def test_scales():
    x = jnp.asarray(np.random.default_rng(0).standard_normal(2500).astype(np.float32))
    k = jax.random.key(0)
    xb = np.pad(np.asarray(x, np.float64), (0, 500)).reshape(3, 1000)
    np.testing.assert_array_equal(qsgd_quantize(x, k, bucket_size=1000).scales, np.abs(xb).max(1).astype(np.float32))
    l2 = qsgd_quantize(x, k, bucket_size=1000, scale="l2").scales
    np.testing.assert_allclose(l2, np.linalg.norm(xb, axis=1), rtol=1e-6)


def test_under_jit_and_vmap():
    rng = np.random.default_rng(1)
    x = sample(rng, 777)
    kw = dict(bits=4, bucket_size=100, scale="l2")
    keys = jax.random.split(jax.random.key(3), 5)
    eager = [qsgd_quantize(x, k, **kw) for k in keys]

    jitted = jax.jit(lambda x, k: qsgd_quantize(x, k, **kw))
    for k, q in zip(keys, eager):
        assert_same_quantized(jitted(x, k), q)

    over_keys = jax.jit(jax.vmap(lambda k: qsgd_quantize(x, k, **kw)))(keys)
    raw_keys = jax.vmap(lambda k: qsgd_quantize(x, k, **kw))(jax.random.key_data(keys))
    decoded = jax.vmap(qsgd_dequantize)(over_keys)
    ref = jax.jit(jax.vmap(lambda k: qsgd_quantize_reference(x, k, **kw)))(keys)
    assert_same_quantized(ref, over_keys)
    assert_bit_equal(jax.vmap(qsgd_dequantize_reference)(ref), decoded)
    assert over_keys.data.shape == (5, qsgd_packed_bytes(777, 4)) and over_keys.size == 777
    for i, q in enumerate(eager):
        row = jax.tree.map(lambda a: a[i], over_keys)
        assert_same_quantized(row, q)
        assert_same_quantized(jax.tree.map(lambda a: a[i], raw_keys), q)
        assert_bit_equal(decoded[i], qsgd_dequantize(q))

    xs = jnp.stack([sample(rng, 777) for _ in range(3)])
    over_both = jax.vmap(lambda x, k: qsgd_quantize(x, k, **kw))(xs, keys[:3])
    nested = jax.vmap(jax.vmap(lambda x, k: qsgd_quantize(x, k, **kw), (None, 0)), (0, None))(xs, keys[:2])
    for i in range(3):
        assert_same_quantized(jax.tree.map(lambda a: a[i], over_both), qsgd_quantize(xs[i], keys[i], **kw))
        for j in range(2):
            got = jax.tree.map(lambda a: a[i, j], nested)
            assert_same_quantized(got, qsgd_quantize(xs[i], keys[j], **kw))


def test_new_key_reuses_compiled_program():
    x = sample(np.random.default_rng(2), 300)
    f = jax.jit(lambda x, k: qsgd_quantize(x, k, bits=2))
    for seed in range(3):
        f(x, jax.random.key(seed))
    assert f._cache_size() == 1


def test_same_key_same_output_different_key_different_output():
    x = sample(np.random.default_rng(3), 4096, zeros=0)
    a = qsgd_quantize(x, jax.random.key(11))
    assert_same_quantized(a, qsgd_quantize(x, jax.random.key(11)))
    assert_same_quantized(a, qsgd_quantize(x, jax.random.PRNGKey(11)))  # raw key, same data
    b = qsgd_quantize(x, jax.random.key(12))
    assert np.mean(np.asarray(a.data) != np.asarray(b.data)) > 0.5
    assert_bit_equal(a.scales, b.scales)


@pytest.mark.parametrize("bits", BITS)
def test_size_one_and_empty(bits):
    for scale in SCALES:
        q, out = both(jnp.array([-0.75], jnp.float32), jax.random.key(0), bits=bits, scale=scale)
        assert q.data.shape == (1,) and q.scales.tolist() == [0.75]
        assert out.tolist() == [-0.75]
        assert int(q.data[0]) == 0  # code L - L = 0
    q = qsgd_quantize(jnp.zeros((0,), jnp.float32), jax.random.key(0), bits=bits)
    assert q.data.shape == (0,) and q.scales.shape == (0,) and qsgd_dequantize(q).shape == (0,)


@pytest.mark.parametrize("scale", SCALES)
def test_all_zero_input(scale):
    for bits in BITS:
        q = qsgd_quantize(jnp.zeros(1500, jnp.float32), jax.random.key(1), bits=bits, scale=scale)
        assert np.all(np.asarray(q.scales) == 0)
        _, codes = numpy_decode(q.data, q.scales, 1500, bits, 1024)
        assert np.all(codes == qsgd_levels(bits))
        out = np.asarray(qsgd_dequantize(q))
        assert np.all(out == 0) and not np.any(np.signbit(out))


@pytest.mark.parametrize("bits", BITS)
def test_representable_values_decode_exactly(bits):
    # "max": values at +-max and 0 are levels; constant input is reproduced exactly.
    for c in (0.3, -1e-20, 7.0, -3.4e38):
        x = jnp.full(2000, c, jnp.float32)
        out = qsgd_dequantize(qsgd_quantize(x, jax.random.key(2), bits=bits, bucket_size=300))
        assert_bit_equal(out, x)
    x = jnp.asarray(np.tile(np.float32([5.0, -5.0, 0.0, -5.0]), 250))
    assert_bit_equal(qsgd_dequantize(qsgd_quantize(x, jax.random.key(3), bits=bits)), x)
    # "l2": a lone non-zero per bucket has norm == |v| exactly (power-of-two rescaling, sqrt(a*a) == |a|).
    x = jnp.zeros(1000, jnp.float32).at[::100].set(jnp.float32(0.3) * jnp.arange(-5, 5, dtype=jnp.float32))
    out = qsgd_dequantize(qsgd_quantize(x, jax.random.key(4), bits=bits, bucket_size=100, scale="l2"))
    assert_bit_equal(out, x)


@pytest.mark.parametrize("scale", SCALES)
def test_non_finite_bucket_decodes_to_nan(scale):
    x = sample(np.random.default_rng(5), 1000).at[250].set(jnp.nan).at[450].set(jnp.inf).at[650].set(-jnp.inf)
    q, out = both(x, jax.random.key(5), bits=4, bucket_size=200, scale=scale)
    scales, out = np.asarray(q.scales), np.asarray(out)
    assert np.isnan(scales[1]) and scales[2] == scales[3] == np.inf and np.all(np.isfinite(scales[[0, 4]]))
    assert np.all(np.isnan(out[200:800]))
    assert np.all(np.isfinite(out[:200])) and np.all(np.isfinite(out[800:]))


def test_huge_finite_values_keep_a_finite_l2_scale():
    x = jnp.asarray(np.float32([3e38, -3e38, 1e38, 2e38]))
    q, out = both(x, jax.random.key(6), scale="l2")
    assert float(q.scales[0]) == np.finfo(np.float32).max
    assert np.all(np.isfinite(out)) and np.all(np.sign(out) == np.sign(np.asarray(x)))


@pytest.mark.parametrize("scale", SCALES)
def test_subnormals_match_reference(scale):
    tiny = np.finfo(np.float32).smallest_subnormal
    x = np.zeros(300, np.float32)
    x[:100] = np.arange(-50, 50) * tiny  # only subnormals: XLA flushes them, the bucket decodes to 0
    x[100:200] = np.arange(100) * tiny
    x[150] = 1.0  # a normal maximum with subnormal neighbours
    x[200:] = np.float32(2.0**-126) * np.arange(1, 101)  # smallest normals; 2**-k rescaling stays exact
    q, out = both(jnp.asarray(x), jax.random.key(8), bits=8, bucket_size=100, scale=scale)
    out = np.asarray(out)
    assert np.all(out[:100] == 0) and out[150] == 1.0
    assert np.all((out == 0) | (np.abs(out) >= np.finfo(np.float32).tiny))  # decoded subnormals flushed too
    assert np.any(out[200:] == 0) and np.all(out[200:] >= 0)


def _many(x, keys, **kw):
    return np.asarray(jax.jit(jax.vmap(lambda k: qsgd_dequantize(qsgd_quantize(x, k, **kw))))(keys), np.float64)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("scale", SCALES)
def test_unbiased(bits, scale):
    n, bucket_size, count = 256, 64, 4096
    x = sample(np.random.default_rng(bits), n, zeros=0.05)
    keys = jax.random.split(jax.random.key(100 + bits), count)
    samples = _many(x, keys, bits=bits, bucket_size=bucket_size, scale=scale)
    # The exact variance: each entry sits on one of two levels `step` apart.
    s = np.repeat(np.asarray(qsgd_quantize(x, keys[0], bits=bits, bucket_size=bucket_size, scale=scale).scales,
                             np.float64), bucket_size)
    L = qsgd_levels(bits)
    t = np.abs(np.asarray(x, np.float64)) / s * L
    p = t - np.floor(t)
    var = (s / L) ** 2 * p * (1 - p)
    err = samples.mean(axis=0) - np.asarray(x, np.float64)
    exact = var < 1e-12 * s**2
    np.testing.assert_allclose(err[exact], 0, atol=1e-6 * s.max())
    z = err[~exact] / np.sqrt(var[~exact] / count)
    assert np.abs(z).max() < 6, np.abs(z).max()
    assert 0.8 < np.mean(z**2) < 1.2, np.mean(z**2)  # the empirical variance matches too


@pytest.mark.parametrize("bits", BITS)
def test_variance_within_qsgd_bounds(bits):
    n, bucket_size, count = 2048, 1024, 2048
    x = sample(np.random.default_rng(bits), n, zeros=0)
    x = x.at[1024:].multiply(jnp.where(jnp.arange(1024) < 16, 100.0, 1.0))  # a spiky bucket
    keys = jax.random.split(jax.random.key(200 + bits), count)
    L, xd = qsgd_levels(bits), np.asarray(x, np.float64)

    # "max": every entry has variance <= scale^2 / (4 L^2).
    samples = _many(x, keys, bits=bits, bucket_size=bucket_size, scale="max")
    scales = np.repeat(np.asarray(qsgd_quantize(x, keys[0], bits=bits).scales, np.float64), bucket_size)
    assert np.all(samples.var(axis=0) <= scales**2 / (4 * L**2) * (1 + 1e-5))

    # "l2": E||Q(v) - v||^2 <= min(d / L^2, sqrt(d) / L) ||v||^2 per bucket.
    samples = _many(x, keys, bits=bits, bucket_size=bucket_size, scale="l2")
    for b in range(n // bucket_size):
        v = xd[b * bucket_size:(b + 1) * bucket_size]
        d = v.size
        mse = np.mean(np.sum((samples[:, b * bucket_size:(b + 1) * bucket_size] - v) ** 2, axis=1))
        bound = min(d / L**2, np.sqrt(d) / L) * np.sum(v**2)
        assert mse <= bound, (b, mse, bound)


def test_sizes_and_wire_bytes():
    assert [qsgd_packed_bytes(10, b) for b in BITS] == [3, 5, 10]
    assert [qsgd_packed_bytes(1, b) for b in BITS] == [1, 1, 1]
    assert qsgd_packed_bytes(0, 2) == 0 and qsgd_num_buckets(0, 5) == 0
    assert qsgd_num_buckets(2049, 1024) == 3 and qsgd_num_buckets(5, 1024) == 1
    assert qsgd_wire_bytes(4096, bits=4, bucket_size=1024) == 2048 + 16
    assert [qsgd_levels(b) for b in BITS] == [1, 7, 127]
    q = qsgd_quantize(jnp.ones(3000, jnp.float32), jax.random.key(0), bits=2, bucket_size=512)
    assert q.wire_bytes == q.data.nbytes + q.scales.nbytes == 750 + 6 * 4


def test_pytree():
    q = qsgd_quantize(jnp.ones(100, jnp.float32), jax.random.key(0), bits=8, bucket_size=30, scale="l2")
    leaves, tree = jax.tree.flatten(q)
    assert len(leaves) == 2
    back = jax.tree.unflatten(tree, leaves)
    assert (back.size, back.bits, back.bucket_size, back.scale) == (100, 8, 30, "l2")
    assert_bit_equal(jax.jit(qsgd_dequantize)(q), qsgd_dequantize(q))
    with pytest.raises(TypeError, match="data must have dtype uint8"):
        QuantizedVector(jnp.zeros(100, jnp.int32), q.scales, 100, 8, 30)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(bits=3), ValueError, r"bits=3 .*2, 4 or 8"),
    (dict(bits=16), ValueError, "bits=16"),
    (dict(bits=True), ValueError, "bits=True"),
    (dict(bits=4.0), ValueError, "bits=4.0"),
    (dict(bucket_size=0), ValueError, "bucket_size=0 must be a positive"),
    (dict(bucket_size=-5), ValueError, "bucket_size=-5"),
    (dict(bucket_size=2.5), TypeError, "bucket_size must be a Python int"),
    (dict(scale="mean"), ValueError, r"scale='mean' is unknown.*\"max\".*\"l2\""),
])
def test_bad_parameters_raise_naming_argument(kwargs, error, match):
    with pytest.raises(error, match=match):
        qsgd_quantize(jnp.ones(10, jnp.float32), jax.random.key(0), **kwargs)


def test_bad_inputs_raise():
    key = jax.random.key(0)
    with pytest.raises(ValueError, match="x must be a 1-D vector"):
        qsgd_quantize(jnp.ones((2, 5), jnp.float32), key)
    with pytest.raises(TypeError, match="x must have dtype float32"):
        qsgd_quantize(jnp.ones(5, jnp.bfloat16), key)
    with pytest.raises(ValueError, match="does not fit int32"):
        jax.eval_shape(lambda x: qsgd_quantize(x, key), jax.ShapeDtypeStruct((2**31,), jnp.float32))
    for bad in (jnp.zeros(2, jnp.int32), jnp.zeros(3, jnp.uint32), jax.random.split(key, 2)):
        with pytest.raises(ValueError, match="key must be"):
            qsgd_quantize(jnp.ones(5, jnp.float32), bad)
    q = qsgd_quantize(jnp.ones(100, jnp.float32), key)
    with pytest.raises(ValueError, match="q: data and scales must have shapes"):
        qsgd_dequantize(QuantizedVector(q.data, q.scales, 101, q.bits, q.bucket_size))
    with pytest.raises(TypeError, match="q must be a QuantizedVector"):
        qsgd_dequantize(q.data)


def test_kernel_errors_name_the_argument():
    _lib.register_cpu_target("sparcml_qsgd_quantize", "SparcmlQsgdQuantize")
    _lib.register_cpu_target("sparcml_qsgd_dequantize", "SparcmlQsgdDequantize")
    x, words = jnp.ones(8, jnp.float32), jax.random.key_data(jax.random.key(0))

    def quantize(bits, bucket_size, scale="max", nbytes=4, nb=1):
        out = (jax.ShapeDtypeStruct((nbytes,), jnp.uint8), jax.ShapeDtypeStruct((nb,), jnp.float32))
        return jax.ffi.ffi_call("sparcml_qsgd_quantize", out)(
            x, words, bits=np.int64(bits), bucket_size=np.int64(bucket_size), scale=scale)[0].block_until_ready()

    with pytest.raises(ERRORS, match="bits=3 is not supported"):
        quantize(3, 8)
    with pytest.raises(ERRORS, match="bucket_size=0 must be a positive"):
        quantize(4, 0)
    with pytest.raises(ERRORS, match="scale=\"mean\" is unknown"):
        quantize(4, 8, "mean")
    with pytest.raises(ERRORS, match=r"packed output must hold ceil\(n \* bits / 8\) = 4"):
        quantize(4, 8, nbytes=3)
    with pytest.raises(ERRORS, match=r"scales must hold ceil\(n / bucket_size\) = 1"):
        jax.ffi.ffi_call("sparcml_qsgd_dequantize", jax.ShapeDtypeStruct((8,), jnp.float32))(
            jnp.zeros(4, jnp.uint8), jnp.ones(2, jnp.float32), bits=np.int64(4), bucket_size=np.int64(8)
        ).block_until_ready()


def test_docstring_examples():
    result = doctest.testmod(qsgd_module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
