"""Placeholder: from_dense and scatter_add in jnp until the C kernels land."""
from __future__ import annotations
import jax.numpy as jnp
from sparcml_jax.stream import INDEX_DTYPE, VALUE_DTYPE, SparseStream, can_switch_to_dense, dense_threshold, check_size


def from_dense(x, capacity=None, delta=1.0):
    x = jnp.asarray(x)
    size = check_size(x.shape[0])
    capacity = size if capacity is None else capacity
    nz = x != 0
    count = jnp.sum(nz, dtype=INDEX_DTYPE)
    (pos,) = jnp.nonzero(nz, size=capacity, fill_value=size)
    pos = pos.astype(INDEX_DTYPE)
    vals = jnp.where(pos < size, x[jnp.minimum(pos, size - 1)], 0.0).astype(VALUE_DTYPE)
    s = SparseStream(pos, vals, jnp.minimum(count, capacity), size)
    if can_switch_to_dense(capacity, size, delta):
        go = count >= dense_threshold(size, delta)
        pad = capacity - size
        return SparseStream(jnp.where(go, jnp.concatenate([jnp.arange(size, dtype=INDEX_DTYPE), jnp.full((pad,), size, INDEX_DTYPE)]), pos),
                            jnp.where(go, jnp.concatenate([x, jnp.zeros((pad,), VALUE_DTYPE)]), vals),
                            jnp.where(go, size, s.nnz).astype(INDEX_DTYPE), size)
    return s


def scatter_add(s, dense):
    valid = jnp.arange(s.capacity) < s.nnz
    return dense.at[s.indices].add(jnp.where(valid, s.values, 0.0), mode="drop")
