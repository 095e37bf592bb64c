"""Merge-sum of two sparse streams: the reduction step of SSAR and DSAR (SparCML §4)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sparcml_jax import _lib
from sparcml_jax.kernels._common import attr_i64, check_same_size, check_stream, on_cpu_or_reference
from sparcml_jax.stream import (INDEX_DTYPE, VALUE_DTYPE, SparseStream, can_switch_to_dense, dense_threshold,
                                with_indices)

_TARGET = "sparcml_merge"


def merge_capacity(a_capacity: int, b_capacity: int, size: int, delta: float = 1.0) -> int:
    """Static output capacity of :func:`merge`: room for the union, or ``size`` once the result may be dense."""
    union = min(a_capacity + b_capacity, size)
    return size if can_switch_to_dense(union, size, delta) else union


def merge(a: SparseStream, b: SparseStream, *, delta: float = 1.0, capacity: int | None = None) -> SparseStream:
    """Returns the stream of ``a + b``.

    The output is dense when its actual count reaches ``dense_threshold(size, delta)`` and its
    capacity can hold ``size`` values. ``capacity`` defaults to :func:`merge_capacity`, which
    always fits. With a smaller one a union that does not fit gives an invalid stream, the first
    ``capacity`` pairs with ``nnz`` the true count, which every consumer rejects (on every rank in
    a collective; see :func:`sparcml_jax.from_dense` for why this does not raise here).

    Example:
      >>> import jax.numpy as jnp
      >>> from sparcml_jax import SparseStream, merge
      >>> a = SparseStream.from_dense(jnp.array([0., 1., 0., 0., 0., 0., 0., 2.]), capacity=2)
      >>> b = SparseStream.from_dense(jnp.array([0., 1., 0., 0., 0., 4., 0., 0.]), capacity=2)
      >>> merge(a, b).to_dense().tolist()
      [0.0, 2.0, 0.0, 0.0, 0.0, 4.0, 0.0, 2.0]
    """
    check_stream(a, "a")
    check_stream(b, "b")
    check_same_size(a, b)
    size = a.size
    if capacity is None:
        capacity = merge_capacity(a.capacity, b.capacity, size, delta)
    threshold = dense_threshold(size, delta)

    def ffi_impl(a, b):
        _lib.register_cpu_target(_TARGET, "SparcmlMerge")
        out = (
            jax.ShapeDtypeStruct((capacity,), INDEX_DTYPE),
            jax.ShapeDtypeStruct((capacity,), VALUE_DTYPE),
            jax.ShapeDtypeStruct((), INDEX_DTYPE),
        )
        idx, val, nnz = jax.ffi.ffi_call(_TARGET, out, vmap_method="sequential")(
            a.indices, a.values, a.nnz, b.indices, b.values, b.nnz, n=attr_i64(size), dense_threshold=attr_i64(threshold)
        )
        return SparseStream(idx, val, nnz, size)

    def reference(a, b):
        return merge_reference(a, b, delta=delta, capacity=capacity)

    return on_cpu_or_reference(ffi_impl, reference, a, b)


def merge_all(streams: list[SparseStream], *, delta: float = 1.0) -> SparseStream:
    """The sum of several streams of one size, merged pairwise in a tree of log2(len) levels."""
    while len(streams) > 1:
        paired = [merge(a, b, delta=delta) for a, b in zip(streams[::2], streams[1::2])]
        streams = paired + ([streams[-1]] if len(streams) % 2 else [])
    return streams[0]


def merge_reference(a: SparseStream, b: SparseStream, *, delta: float = 1.0, capacity: int | None = None) -> SparseStream:
    """Pure-jnp :func:`merge` (no validation): the dense sum, re-sparsified by the same rule."""
    a, b = with_indices(a), with_indices(b)
    size = a.size
    if capacity is None:
        capacity = merge_capacity(a.capacity, b.capacity, size, delta)
    dense = _scatter(a, jnp.zeros((size,), VALUE_DTYPE))
    dense = _scatter(b, dense)
    support = jnp.zeros((size,), bool)
    support = support.at[a.indices].set(jnp.arange(a.capacity) < a.nnz, mode="drop")
    support = support | jnp.zeros((size,), bool).at[b.indices].set(jnp.arange(b.capacity) < b.nnz, mode="drop")
    count = jnp.sum(support, dtype=INDEX_DTYPE)
    (positions,) = jnp.nonzero(support, size=capacity, fill_value=size)
    positions = positions.astype(INDEX_DTYPE)
    sparse_values = jnp.where(positions < size, dense[jnp.minimum(positions, size - 1)], 0.0) if size else jnp.zeros((capacity,), VALUE_DTYPE)
    if capacity >= size:
        go_dense = count >= dense_threshold(size, delta)
        pad = capacity - size
        dense_idx = jnp.concatenate([jnp.arange(size, dtype=INDEX_DTYPE), jnp.full((pad,), size, INDEX_DTYPE)])
        dense_val = jnp.concatenate([dense, jnp.zeros((pad,), VALUE_DTYPE)])
        return SparseStream(
            jnp.where(go_dense, dense_idx, positions),
            jnp.where(go_dense, dense_val, sparse_values),
            jnp.where(go_dense, size, count).astype(INDEX_DTYPE),
            size,
        )
    return SparseStream(positions, sparse_values, count, size)


def _scatter(s: SparseStream, dense: jax.Array) -> jax.Array:
    valid = jnp.arange(s.capacity) < s.nnz
    return dense.at[s.indices].add(jnp.where(valid, s.values, 0.0), mode="drop")
