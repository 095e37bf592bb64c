"""Stream construction and SparCML's split phase (paper §3 streams, §4 Split_allgather).

* :func:`from_dense` / :func:`to_dense` / :func:`scatter_add`: dense vector <-> :class:`SparseStream`.
* :func:`coalesce`: unordered (index, value) pairs with repeats -> :class:`SparseStream`, the
  natural form of an embedding or sparse-feature gradient, without touching a dense vector.
* :func:`partition_bounds` / :func:`split`: the index space ``[0, size)`` cut into ``parts``
  ranges (the last takes the remainder) and, for a stream, which of its pairs fall in each range.
  This is the split phase of ``SSAR_Split_allgather`` and ``DSAR_Split_allgather``.
* :func:`gather`: a stream of the entries of a dense vector at a sorted support.
* :func:`pack` / :func:`unpack` / :func:`to_dense_parts`: a gradient's leaves <-> the one flat
  buffer its collective takes, and a summed stream straight into the leaves.

Each kernel runs in C on CPU and has a pure-jnp ``*_reference`` used on other platforms and in
tests. Static arguments are checked at trace time; stream contents (sorted, in range, nnz within
capacity) are checked at run time by the C kernels, whose errors name the argument.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sparcml_jax import _lib
from sparcml_jax.kernels._common import attr_i64, check_stream, check_vector, on_cpu_or_reference, scalar_i32
from sparcml_jax.stream import (MAX_SIZE, INDEX_DTYPE, VALUE_DTYPE, SparseStream, check_size, dense_threshold,
                                install_conversions, with_indices)

_FROM_DENSE = "sparcml_from_dense"
_FROM_DENSE_COUNTED = "sparcml_from_dense_counted"
_COALESCE = "sparcml_coalesce"
_SCATTER_ADD = "sparcml_scatter_add"
_TO_DENSE = "sparcml_to_dense"
_SPLIT = "sparcml_split"
_GATHER = "sparcml_gather"
_PACK = "sparcml_pack"
_UNPACK = "sparcml_unpack"
_TO_DENSE_PARTS = "sparcml_to_dense_parts"


def _check_count(value: Any, name: str, minimum: int) -> int:
    """A static Python int in [minimum, MAX_SIZE]."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be a Python int (a static shape), got {type(value).__name__}")
    value = int(value)
    if not minimum <= value <= MAX_SIZE:
        raise ValueError(f"{name} must lie in [{minimum}, {MAX_SIZE}], got {value}")
    return value


def _check_dense_size(stream: SparseStream, dense: jax.Array) -> None:
    if dense.shape[0] != stream.size:
        raise ValueError(
            f"dense has length {dense.shape[0]} but stream describes a vector of size {stream.size}; "
            "they must match"
        )


def _padded_dense(x: jax.Array, capacity: int) -> tuple[jax.Array, jax.Array]:
    """Indices and values of the dense representation of ``x`` in buffers of ``capacity >= x.size``."""
    size = x.shape[0]
    pad = capacity - size
    idx = jnp.concatenate([jnp.arange(size, dtype=INDEX_DTYPE), jnp.full((pad,), size, INDEX_DTYPE)])
    val = jnp.concatenate([x, jnp.zeros((pad,), VALUE_DTYPE)])
    return idx, val


def _take_or_zero(x: jax.Array, positions: jax.Array) -> jax.Array:
    """``x[positions]`` where ``positions < x.size``, 0 elsewhere (padding)."""
    size = x.shape[0]
    if size == 0:
        return jnp.zeros(positions.shape, VALUE_DTYPE)
    return jnp.where(positions < size, x[jnp.clip(positions, 0, size - 1)], 0.0).astype(VALUE_DTYPE)


# --------------------------------------------------------------------------------------------
# from_dense


def from_dense(x: jax.Array, capacity: int | None = None, delta: float = 1.0) -> SparseStream:
    """The stream of the nonzeros of a 1-D float32 vector, in index order.

    NaN counts as nonzero, ``-0.0`` and subnormals (XLA:CPU flushes them) as zero. ``capacity`` (static, default ``x.size``) is the
    length of the pair buffers. When the count reaches ``dense_threshold(x.size, delta)`` and
    ``capacity >= x.size`` the result is the dense representation (``nnz == size``).

    More nonzeros than ``capacity`` (when the dense form is not possible) give an invalid stream:
    the first ``capacity`` nonzeros with ``nnz`` the true count. Every consumer (``to_dense``,
    ``merge``, the collectives) raises on it, and a collective raises on every rank. Raising here
    instead would stop only this rank, leaving its peers blocked in the collective.

    Example:
      >>> import jax.numpy as jnp
      >>> from sparcml_jax import from_dense
      >>> s = from_dense(jnp.array([0., 2., 0., 0., 0., 0., 5., 0.]), capacity=3)
      >>> s.indices.tolist(), s.values.tolist(), int(s.nnz)
      ([1, 6, 8], [2.0, 5.0, 0.0], 2)
      >>> int(from_dense(jnp.array([1., 2., 0., 3.])).nnz)  # 3 of 4 nonzero: dense form
      4
    """
    x = check_vector(x, "x")
    size = check_size(x.shape[0], "x.size")
    capacity = size if capacity is None else _check_count(capacity, "capacity", 0)
    threshold = dense_threshold(size, delta)

    def ffi_impl(x):
        _lib.register_cpu_target(_FROM_DENSE, "SparcmlFromDense")
        out = (
            jax.ShapeDtypeStruct((capacity,), INDEX_DTYPE),
            jax.ShapeDtypeStruct((capacity,), VALUE_DTYPE),
            jax.ShapeDtypeStruct((), INDEX_DTYPE),
        )
        idx, val, nnz = jax.ffi.ffi_call(_FROM_DENSE, out, vmap_method="sequential")(
            x, dense_threshold=attr_i64(threshold)
        )
        return SparseStream(idx, val, nnz, size)

    def reference(x):
        return from_dense_reference(x, capacity=capacity, delta=delta)

    return on_cpu_or_reference(ffi_impl, reference, x)


def from_dense_counted(x: jax.Array, capacity: int) -> tuple[SparseStream, jax.Array]:
    """The first ``capacity`` nonzeros of ``x`` and the true nonzero count, in one pass.

    Unlike :func:`from_dense` it never raises and never returns the dense form: callers compare
    the count with ``capacity`` (for example collectively, so that all ranks take the same path).

    Example:
      >>> import jax.numpy as jnp
      >>> from sparcml_jax.kernels.partition import from_dense_counted
      >>> s, count = from_dense_counted(jnp.array([0., 2., 3., 0., 4.]), capacity=2)
      >>> s.indices.tolist(), int(s.nnz), int(count)
      ([1, 2], 2, 3)
    """
    x = check_vector(x, "x")
    size = check_size(x.shape[0], "x.size")
    capacity = _check_count(capacity, "capacity", 0)

    def ffi_impl(x):
        _lib.register_cpu_target(_FROM_DENSE_COUNTED, "SparcmlFromDenseCounted")
        out = (
            jax.ShapeDtypeStruct((capacity,), INDEX_DTYPE),
            jax.ShapeDtypeStruct((capacity,), VALUE_DTYPE),
            jax.ShapeDtypeStruct((), INDEX_DTYPE),
            jax.ShapeDtypeStruct((), INDEX_DTYPE),
        )
        idx, val, nnz, count = jax.ffi.ffi_call(_FROM_DENSE_COUNTED, out, vmap_method="sequential")(x)
        return SparseStream(idx, val, nnz, size), count

    def reference(x):
        count = jnp.sum(x != 0, dtype=INDEX_DTYPE)
        (positions,) = jnp.nonzero(x != 0, size=capacity, fill_value=size)
        positions = positions.astype(INDEX_DTYPE)
        return SparseStream(positions, _take_or_zero(x, positions), jnp.minimum(count, capacity), size), count

    return on_cpu_or_reference(ffi_impl, reference, x)


def from_dense_reference(x: jax.Array, capacity: int | None = None, delta: float = 1.0) -> SparseStream:
    """Pure-jnp :func:`from_dense`."""
    size = x.shape[0]
    capacity = size if capacity is None else capacity
    nonzero = x != 0
    count = jnp.sum(nonzero, dtype=INDEX_DTYPE)
    (positions,) = jnp.nonzero(nonzero, size=capacity, fill_value=size)
    positions = positions.astype(INDEX_DTYPE)
    values = _take_or_zero(x, positions)
    nnz = count
    if capacity < size:
        return SparseStream(positions, values, nnz, size)
    go_dense = count >= dense_threshold(size, delta)
    dense_idx, dense_val = _padded_dense(x, capacity)
    return SparseStream(
        jnp.where(go_dense, dense_idx, positions),
        jnp.where(go_dense, dense_val, values),
        jnp.where(go_dense, size, nnz).astype(INDEX_DTYPE),
        size,
    )


# --------------------------------------------------------------------------------------------
# coalesce


def coalesce(indices: jax.Array, values: jax.Array, size: int, capacity: int | None = None,
             delta: float = 1.0) -> SparseStream:
    """The stream of ``sum_i values[i] * e[indices[i]]``: pairs in any order, repeats summed.

    This builds the gradient of a lookup ``w[indices]`` from the gradient with respect to the
    looked-up entries, in O(m log N) for m pairs instead of a pass over all ``size`` entries: the
    naturally sparse case of SparCML §8.2 (sparse features, embeddings). ``indices`` and
    ``values`` have the same shape (any rank; they are flattened). An index equal to ``size``
    marks padding and is dropped, as in a stream's tail. Repeats are summed in input order.
    ``capacity`` (static, default the number of pairs) bounds the distinct indices; with
    ``capacity >= size`` and at least ``dense_threshold(size, delta)`` of them the result is the
    dense representation.

    Bad input gives an invalid stream that every consumer rejects, on every rank in a collective
    (see :func:`from_dense`): an index outside ``[0, size]`` gives the one-pair stream of the
    first such index, and more distinct indices than ``capacity`` keep the first ``capacity``
    with ``nnz`` the true count.

    Example:
      >>> import jax.numpy as jnp
      >>> from sparcml_jax import coalesce
      >>> s = coalesce(jnp.array([[6, 1], [1, 8]], jnp.int32), jnp.array([[5., 2.], [1., 9.]]), size=8)
      >>> s.indices.tolist(), s.values.tolist(), int(s.nnz)   # index 8 == size: padding
      ([1, 6, 8, 8], [3.0, 5.0, 0.0, 0.0], 2)
    """
    indices, values = jnp.asarray(indices), jnp.asarray(values)
    if indices.shape != values.shape:
        raise ValueError(f"indices and values must have the same shape, got {indices.shape} and {values.shape}")
    idx = check_vector(indices.ravel(), "indices", INDEX_DTYPE)
    val = check_vector(values.ravel(), "values")
    check_size(idx.shape[0], "indices.size")
    size = check_size(size, "size")
    capacity = idx.shape[0] if capacity is None else _check_count(capacity, "capacity", 0)
    threshold = dense_threshold(size, delta)

    def ffi_impl(idx, val):
        _lib.register_cpu_target(_COALESCE, "SparcmlCoalesce")
        out = (
            jax.ShapeDtypeStruct((capacity,), INDEX_DTYPE),
            jax.ShapeDtypeStruct((capacity,), VALUE_DTYPE),
            jax.ShapeDtypeStruct((), INDEX_DTYPE),
        )
        out_idx, out_val, nnz = jax.ffi.ffi_call(_COALESCE, out, vmap_method="sequential")(
            idx, val, n=attr_i64(size), dense_threshold=attr_i64(threshold)
        )
        return SparseStream(out_idx, out_val, nnz, size)

    def reference(idx, val):
        return coalesce_reference(idx, val, size, capacity=capacity, delta=delta)

    return on_cpu_or_reference(ffi_impl, reference, idx, val)


def coalesce_reference(indices: jax.Array, values: jax.Array, size: int, capacity: int | None = None,
                       delta: float = 1.0) -> SparseStream:
    """Pure-jnp :func:`coalesce`."""
    idx, val = indices.ravel(), values.ravel().astype(VALUE_DTYPE)
    m = idx.shape[0]
    capacity = m if capacity is None else capacity
    stream = _coalesce_valid_reference(idx, val, size, capacity, delta)
    if m == 0:
        return stream
    outside = (idx < 0) | (idx > size)
    first_bad = jnp.argmax(outside)
    head = jnp.arange(capacity) == 0
    poisoned = SparseStream(jnp.where(head, idx[first_bad], size).astype(INDEX_DTYPE),
                            jnp.where(head, val[first_bad], 0.0).astype(VALUE_DTYPE), jnp.int32(1), size)
    return jax.tree.map(lambda bad, good: jnp.where(jnp.any(outside), bad, good), poisoned, stream)


def _coalesce_valid_reference(idx: jax.Array, val: jax.Array, size: int, capacity: int, delta: float) -> SparseStream:
    m = idx.shape[0]
    order = jnp.argsort(idx, stable=True)
    idx, val = idx[order].astype(INDEX_DTYPE), val[order]
    kept = (idx >= 0) & (idx < size)
    first = kept & jnp.concatenate([jnp.ones((min(m, 1),), bool), idx[1:] != idx[:-1]])
    slot = jnp.where(kept, jnp.cumsum(first) - 1, capacity)
    distinct = jnp.sum(first, dtype=INDEX_DTYPE)
    out_idx = jnp.full((capacity,), size, INDEX_DTYPE).at[jnp.where(first, slot, capacity)].set(idx, mode="drop")
    out_val = jnp.zeros((capacity,), VALUE_DTYPE).at[slot].add(val, mode="drop")
    nnz = distinct
    if capacity < size:
        return SparseStream(out_idx, out_val, nnz, size)
    dense = jnp.zeros((size,), VALUE_DTYPE).at[jnp.where(kept, idx, size)].add(val, mode="drop")
    dense_idx, dense_val = _padded_dense(dense, capacity)
    go_dense = distinct >= dense_threshold(size, delta)
    return SparseStream(jnp.where(go_dense, dense_idx, out_idx), jnp.where(go_dense, dense_val, out_val),
                        jnp.where(go_dense, size, nnz).astype(INDEX_DTYPE), size)


# --------------------------------------------------------------------------------------------
# scatter_add


def scatter_add(stream: SparseStream, dense: jax.Array) -> jax.Array:
    """``dense + stream`` as a float32[size] vector (``stream.to_dense()`` is ``scatter_add(stream, 0)``).

    Example:
      >>> import jax.numpy as jnp
      >>> from sparcml_jax import from_dense, scatter_add
      >>> s = from_dense(jnp.array([0., 2., 0., 0., 0., 0., 5., 0.]), capacity=3)
      >>> scatter_add(s, jnp.ones(8)).tolist()
      [1.0, 3.0, 1.0, 1.0, 1.0, 1.0, 6.0, 1.0]
    """
    check_stream(stream, "stream")
    dense = check_vector(dense, "dense")
    _check_dense_size(stream, dense)

    def ffi_impl(stream, dense):
        _lib.register_cpu_target(_SCATTER_ADD, "SparcmlScatterAdd")
        out = jax.ShapeDtypeStruct((stream.size,), VALUE_DTYPE)
        # dense is updated in place (the kernel handles out == dense).
        return jax.ffi.ffi_call(_SCATTER_ADD, out, vmap_method="sequential", input_output_aliases={3: 0})(
            stream.indices, stream.values, stream.nnz, dense
        )

    return on_cpu_or_reference(ffi_impl, scatter_add_reference, stream, dense)


def scatter_add_reference(stream: SparseStream, dense: jax.Array) -> jax.Array:
    """Pure-jnp :func:`scatter_add` (no validation; pairs past ``nnz`` are ignored)."""
    if stream.dense_by_construction:
        return dense + jnp.where(stream.nnz == stream.size, stream.values, 0.0)
    valid = jnp.arange(stream.capacity) < stream.nnz
    where = jnp.where(valid, stream.indices, stream.size)
    return dense.at[where].add(jnp.where(valid, stream.values, 0.0), mode="drop")


def to_dense(stream: SparseStream) -> jax.Array:
    """The float32[size] vector ``stream`` represents (:meth:`SparseStream.to_dense`).

    The C kernel zero-fills and scatters one cache-sized block at a time, so the vector crosses
    memory once: densifying costs about a copy of it. A stream dense by construction is its
    values.

    Example:
      >>> import jax.numpy as jnp
      >>> from sparcml_jax import from_dense
      >>> from sparcml_jax.kernels.partition import to_dense
      >>> to_dense(from_dense(jnp.array([0., 2., 0., 5.]), capacity=2)).tolist()
      [0.0, 2.0, 0.0, 5.0]
    """
    check_stream(stream, "stream")
    if stream.dense_by_construction:
        return stream.values

    def ffi_impl(stream):
        _lib.register_cpu_target(_TO_DENSE, "SparcmlToDense")
        out = jax.ShapeDtypeStruct((stream.size,), VALUE_DTYPE)
        return jax.ffi.ffi_call(_TO_DENSE, out, vmap_method="sequential")(stream.indices, stream.values, stream.nnz)

    return on_cpu_or_reference(ffi_impl, to_dense_reference, stream)


def to_dense_reference(stream: SparseStream) -> jax.Array:
    """Pure-jnp :func:`to_dense` (no validation; pairs past ``nnz`` are ignored)."""
    return scatter_add_reference(stream, jnp.zeros((stream.size,), VALUE_DTYPE))


# --------------------------------------------------------------------------------------------
# pack / unpack / to_dense_parts
#
# XLA:CPU joins reshaped leaves element by element and splits larger loops across its thread
# pool; a step that packs a model's gradient, and cuts the sum back, pays that twice. These are
# one memcpy per leaf on the calling thread.


def pack(parts: Sequence[jax.Array]) -> jax.Array:
    """The 1-D ``parts`` (all of one dtype) laid end to end: ``jnp.concatenate(parts)``.

    Example:
      >>> import jax.numpy as jnp
      >>> from sparcml_jax.kernels.partition import pack
      >>> pack([jnp.array([1.0, 2.0]), jnp.zeros(0), jnp.array([3.0])]).tolist()
      [1.0, 2.0, 3.0]
    """
    parts = _check_parts(parts)

    def ffi_impl(*parts):
        _lib.register_cpu_target(_PACK, "SparcmlPack")
        out = jax.ShapeDtypeStruct((sum(p.shape[0] for p in parts),), parts[0].dtype)
        return jax.ffi.ffi_call(_PACK, out, vmap_method="sequential")(*parts)

    return on_cpu_or_reference(ffi_impl, pack_reference, *parts)


def pack_reference(*parts: jax.Array) -> jax.Array:
    """Pure-jnp :func:`pack`."""
    return jnp.concatenate(parts)


def unpack(flat: jax.Array, sizes: Sequence[int]) -> list[jax.Array]:
    """``flat`` cut into consecutive 1-D pieces of ``sizes`` entries (the inverse of :func:`pack`).

    Example:
      >>> import jax.numpy as jnp
      >>> from sparcml_jax.kernels.partition import unpack
      >>> [p.tolist() for p in unpack(jnp.arange(5.0), [2, 0, 3])]
      [[0.0, 1.0], [], [2.0, 3.0, 4.0]]
    """
    flat = jnp.asarray(flat)
    sizes = _check_sizes(sizes, "sizes")
    if flat.ndim != 1 or flat.shape[0] != sum(sizes):
        raise ValueError(f"unpack: flat must be a vector of sum(sizes) = {sum(sizes)} entries, got shape "
                         f"{flat.shape}; pass the sizes of the pieces it was packed from")
    if not sizes:
        return []

    def ffi_impl(flat):
        _lib.register_cpu_target(_UNPACK, "SparcmlUnpack")
        out = [jax.ShapeDtypeStruct((m,), flat.dtype) for m in sizes]
        return list(jax.ffi.ffi_call(_UNPACK, out, vmap_method="sequential")(flat))

    return on_cpu_or_reference(ffi_impl, lambda flat: unpack_reference(flat, sizes), flat)


def unpack_reference(flat: jax.Array, sizes: Sequence[int]) -> list[jax.Array]:
    """Pure-jnp :func:`unpack` (no validation)."""
    offsets = np.cumsum([0, *sizes])
    return [flat[offsets[i]:offsets[i + 1]] for i in range(len(sizes))]


def to_dense_parts(stream: SparseStream, sizes: Sequence[int]) -> list[jax.Array]:
    """``unpack(to_dense(stream), sizes)`` without the float32[size] vector in between: each
    piece is zero-filled and takes its pairs one cache-sized block at a time.

    Example:
      >>> import jax.numpy as jnp
      >>> from sparcml_jax import from_dense
      >>> from sparcml_jax.kernels.partition import to_dense_parts
      >>> s = from_dense(jnp.array([0., 2., 0., 5., 7.]), capacity=3)
      >>> [p.tolist() for p in to_dense_parts(s, [2, 3])]
      [[0.0, 2.0], [0.0, 5.0, 7.0]]
    """
    check_stream(stream, "stream")
    sizes = _check_sizes(sizes, "sizes")
    if sum(sizes) != stream.size:
        raise ValueError(f"to_dense_parts: sizes sum to {sum(sizes)}, but the stream describes a vector of "
                         f"{stream.size}; pass the sizes of the pieces of that vector")
    if stream.dense_by_construction:
        return unpack(stream.values, sizes)
    if not sizes:
        return []

    def ffi_impl(stream):
        _lib.register_cpu_target(_TO_DENSE_PARTS, "SparcmlToDenseParts")
        out = [jax.ShapeDtypeStruct((m,), VALUE_DTYPE) for m in sizes]
        return list(jax.ffi.ffi_call(_TO_DENSE_PARTS, out, vmap_method="sequential")(
            stream.indices, stream.values, stream.nnz))

    return on_cpu_or_reference(ffi_impl, lambda stream: to_dense_parts_reference(stream, sizes), stream)


def to_dense_parts_reference(stream: SparseStream, sizes: Sequence[int]) -> list[jax.Array]:
    """Pure-jnp :func:`to_dense_parts` (no validation; pairs past ``nnz`` are ignored)."""
    return unpack_reference(to_dense_reference(stream), sizes)


def _check_parts(parts: Sequence[jax.Array]) -> list[jax.Array]:
    parts = [jnp.asarray(p) for p in parts]
    if not parts:
        raise ValueError("pack: parts is empty; pack at least one vector")
    for i, p in enumerate(parts):
        if p.ndim != 1:
            raise ValueError(f"pack: parts[{i}] must be a 1-D vector, got shape {p.shape}; flatten it with .ravel()")
        if p.dtype != parts[0].dtype:
            raise TypeError(f"pack: parts[{i}] has dtype {p.dtype}, parts[0] {parts[0].dtype}; convert them to one "
                            "dtype with .astype()")
    return parts


def _check_sizes(sizes: Sequence[int], name: str) -> list[int]:
    sizes = list(sizes)
    if any(isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m < 0 for m in sizes):
        raise ValueError(f"{name} must be non-negative static ints, got {sizes}")
    return [int(m) for m in sizes]


# --------------------------------------------------------------------------------------------
# partition_bounds / split


def partition_bounds(size: int, parts: int) -> np.ndarray:
    """Static int64[parts + 1] bounds: part ``r`` covers ``[bounds[r], bounds[r + 1])``.

    Every part has ``size // parts`` entries and the last one also takes the remainder, as in
    SparCML. With ``parts > size`` all parts but the last are empty.

    Example:
      >>> from sparcml_jax import partition_bounds
      >>> partition_bounds(10, 3).tolist()
      [0, 3, 6, 10]
    """
    size = check_size(size)
    parts = _check_count(parts, "parts", 1)
    bounds = np.arange(parts + 1, dtype=np.int64) * (size // parts)
    bounds[-1] = size
    return bounds


def split(stream: SparseStream, parts: int) -> jax.Array:
    """int32[parts + 1] offsets into the stream's pairs: pairs ``offsets[r]:offsets[r + 1]`` fall in part ``r``.

    The parts are those of :func:`partition_bounds`; for a dense stream the offsets equal the
    bounds. This is the split phase of SparCML's ``SSAR_Split_allgather`` and
    ``DSAR_Split_allgather``: pairs of part ``r`` go to rank ``r``.

    Example:
      >>> import jax.numpy as jnp
      >>> from sparcml_jax import from_dense, split
      >>> s = from_dense(jnp.array([1., 0., 0., 2., 0., 0., 0., 0., 0., 3.]), capacity=4)
      >>> split(s, 3).tolist()  # parts [0, 3), [3, 6), [6, 10)
      [0, 1, 2, 3]
    """
    stream = with_indices(check_stream(stream, "stream"))  # a dense stream's offsets are the bounds
    parts = _check_count(parts, "parts", 1)
    size = stream.size

    def ffi_impl(stream):
        _lib.register_cpu_target(_SPLIT, "SparcmlSplit")
        out = jax.ShapeDtypeStruct((parts + 1,), INDEX_DTYPE)
        return jax.ffi.ffi_call(_SPLIT, out, vmap_method="sequential")(stream.indices, stream.nnz, n=attr_i64(size))

    def reference(stream):
        return split_reference(stream, parts)

    return on_cpu_or_reference(ffi_impl, reference, stream)


def split_reference(stream: SparseStream, parts: int) -> jax.Array:
    """Pure-jnp :func:`split` (no validation): a sorted search of the part bounds."""
    bounds = jnp.asarray(partition_bounds(stream.size, parts).astype(np.int32))
    valid = jnp.arange(stream.capacity) < stream.nnz
    keys = jnp.where(valid, stream.indices, stream.size)
    return jnp.searchsorted(keys, bounds, side="left").astype(INDEX_DTYPE)


# --------------------------------------------------------------------------------------------
# gather


def gather(dense: jax.Array, indices: jax.Array, nnz: Any) -> SparseStream:
    """The stream of pairs ``(indices[i], dense[indices[i]])`` for ``i < nnz``.

    ``indices`` (int32[capacity]) must be strictly increasing in ``[0, dense.size)`` over its
    first ``nnz`` entries (checked at run time); entries past ``nnz`` are ignored and the result
    is tail padded. ``nnz == dense.size`` yields the dense representation.

    Example:
      >>> import jax.numpy as jnp
      >>> from sparcml_jax import gather
      >>> s = gather(jnp.arange(6.0), jnp.array([1, 4, 0], jnp.int32), 2)
      >>> s.indices.tolist(), s.values.tolist(), int(s.nnz)
      ([1, 4, 6], [1.0, 4.0, 0.0], 2)
    """
    dense = check_vector(dense, "dense")
    size = check_size(dense.shape[0], "dense.size")
    indices = check_vector(indices, "indices", INDEX_DTYPE)
    if jnp.ndim(nnz) != 0 or not jnp.issubdtype(jnp.result_type(nnz), jnp.integer):
        raise TypeError(f"nnz must be an integer scalar, got shape {jnp.shape(nnz)} and dtype {jnp.result_type(nnz)}")
    nnz = scalar_i32(nnz)
    capacity = indices.shape[0]

    def ffi_impl(dense, indices, nnz):
        _lib.register_cpu_target(_GATHER, "SparcmlGather")
        out = (jax.ShapeDtypeStruct((capacity,), INDEX_DTYPE), jax.ShapeDtypeStruct((capacity,), VALUE_DTYPE))
        idx, val = jax.ffi.ffi_call(_GATHER, out, vmap_method="sequential")(dense, indices, nnz)
        return SparseStream(idx, val, nnz, size)

    return on_cpu_or_reference(ffi_impl, gather_reference, dense, indices, nnz)


def gather_reference(dense: jax.Array, indices: jax.Array, nnz: Any) -> SparseStream:
    """Pure-jnp :func:`gather` (no validation)."""
    size = dense.shape[0]
    capacity = indices.shape[0]
    nnz = scalar_i32(nnz)
    valid = jnp.arange(capacity) < nnz
    positions = jnp.where(valid, indices, size).astype(INDEX_DTYPE)
    values = _take_or_zero(dense, positions)
    if capacity < size:
        return SparseStream(positions, values, nnz, size)
    dense_idx, dense_val = _padded_dense(dense, capacity)
    is_dense = nnz == size
    return SparseStream(jnp.where(is_dense, dense_idx, positions), jnp.where(is_dense, dense_val, values), nnz, size)


__all__ = [
    "from_dense",
    "from_dense_reference",
    "gather",
    "gather_reference",
    "partition_bounds",
    "scatter_add",
    "scatter_add_reference",
    "split",
    "split_reference",
    "to_dense",
    "to_dense_reference",
]


install_conversions(from_dense=from_dense, to_dense=to_dense)
