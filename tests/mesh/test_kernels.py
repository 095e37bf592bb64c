"""Every public kernel inside a jitted ``jax.shard_map`` equals the same kernel applied to each
device's shard outside it: the C kernel on CPU and its jnp reference (what GPUs and TPUs run)
both trace there, with inputs that vary over the mesh axis and inputs that do not.

Runs with forced CPU devices, spawned by tests/test_mesh_spawn.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import sparcml_jax as sj
from sparcml_jax import sparsifiers

DEVICES = 4
SIZE = 300


def _shards(seed: int) -> np.ndarray:
    """Integer-valued rows, one per device, about a third of them zero."""
    rng = np.random.default_rng(seed)
    x = rng.integers(-9, 10, (DEVICES, SIZE)).astype(np.float32)
    return np.where(rng.random((DEVICES, SIZE)) < 0.35, 0, x)


def _on_mesh(kernel, *shared):
    """``kernel(row, *shared)`` on every device of a 1-D mesh, its results stacked by device."""
    mesh = jax.make_mesh((DEVICES,), ("data",), devices=jax.devices()[:DEVICES])

    def per_device(rows, *shared):
        return jax.tree.map(lambda a: jnp.asarray(a)[None], kernel(rows[0], *shared))

    run = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P("data"),) + (P(),) * len(shared),
                                out_specs=P("data")))
    return lambda rows: run(jax.device_put(rows, NamedSharding(mesh, P("data"))), *shared)


def _stream(x: jax.Array, capacity: int = 240) -> sj.SparseStream:
    return sj.from_dense(x, capacity=capacity)


_KEY = jax.random.key(3)
_REPLICATED = sj.coalesce(jnp.array([3, 70, 299], jnp.int32), jnp.array([1.0, -2.0, 5.0]), size=SIZE)

KERNELS = {
    "topk": lambda x: sj.topk(x, 17),
    "topk_reference": lambda x: sj.topk_reference(x, 17),
    "from_dense": lambda x: sj.from_dense(x, capacity=120),
    "from_dense dense": lambda x: sj.from_dense(x, capacity=SIZE),
    "from_dense_reference": lambda x: sj.from_dense_reference(x, capacity=120),
    "SparseStream.from_dense": lambda x: sj.SparseStream.from_dense(x, capacity=8),
    "to_dense": lambda x: _stream(x).to_dense(),
    "coalesce": lambda x: sj.coalesce(jnp.abs(x).astype(jnp.int32) * 31 % SIZE, x, size=SIZE, capacity=64),
    "coalesce_reference": lambda x: sj.coalesce_reference(jnp.abs(x).astype(jnp.int32) * 31 % SIZE, x, size=SIZE,
                                                          capacity=64),
    "scatter_add": lambda x: sj.scatter_add(_stream(x), jnp.ones(SIZE)),
    "scatter_add_reference": lambda x: sj.scatter_add_reference(_stream(x), jnp.ones(SIZE)),
    "split": lambda x: sj.split(_stream(x), 5),
    "split_reference": lambda x: sj.split_reference(_stream(x), 5),
    "gather": lambda x: sj.gather(x, jnp.arange(0, SIZE, 7, dtype=jnp.int32), 30),
    "gather_reference": lambda x: sj.gather_reference(x, jnp.arange(0, SIZE, 7, dtype=jnp.int32), 30),
    "merge": lambda x: sj.merge(_stream(x), _stream(x[::-1])),
    "merge_reference": lambda x: sj.merge_reference(_stream(x), _stream(x[::-1])),
    "qsgd": lambda x: sj.qsgd_dequantize(sj.qsgd_quantize(x, _KEY, bits=4, bucket_size=64)),
    "qsgd_reference": lambda x: sj.qsgd_dequantize_reference(sj.qsgd_quantize_reference(x, _KEY, bits=4,
                                                                                        bucket_size=64)),
    "randomk": lambda x: sparsifiers.randomk(x, 9, _KEY),
    "threshold": lambda x: sparsifiers.threshold(4.0)(x, 50, None),
}


@pytest.mark.parametrize("name", KERNELS)
def test_kernel_inside_shard_map_equals_it_outside(name):
    rows = _shards(len(name))
    got = _on_mesh(KERNELS[name])(rows)
    for device, row in enumerate(rows):
        want = KERNELS[name](jnp.asarray(row))
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(g)[device], np.asarray(w), err_msg=f"{name}, device {device}")


@pytest.mark.parametrize("kernel", [sj.merge, sj.merge_reference])
def test_a_varying_stream_merges_with_a_replicated_one(kernel):
    """One operand varies over the mesh axis, the other is the same on every device."""
    rows = _shards(11)
    got = _on_mesh(lambda x, shared: kernel(_stream(x), shared), _REPLICATED)(rows)
    for device, row in enumerate(rows):
        want = (np.asarray(_stream(jnp.asarray(row)).to_dense()) + np.asarray(_REPLICATED.to_dense()))
        merged = sj.SparseStream(*(np.asarray(a)[device] for a in (got.indices, got.values, got.nnz)), SIZE)
        np.testing.assert_array_equal(np.asarray(merged.to_dense()), want)


def test_replicated_inputs_stay_replicated():
    """A kernel whose inputs vary over no axis returns values that vary over none, so they can
    leave the shard_map unsharded."""
    mesh = jax.make_mesh((DEVICES,), ("data",), devices=jax.devices()[:DEVICES])
    x = jnp.asarray(_shards(5)[0])
    run = jax.jit(jax.shard_map(lambda v: sj.topk(v, 6).values, mesh=mesh, in_specs=P(), out_specs=P()))
    np.testing.assert_array_equal(np.asarray(run(x)), np.asarray(sj.topk(x, 6).values))
