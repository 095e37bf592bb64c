"""Helpers shared by the kernel wrappers: trace-time validation and platform dispatch."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from sparcml_jax.comm._compat import varying_axes
from sparcml_jax.stream import INDEX_DTYPE, VALUE_DTYPE, SparseStream


def on_cpu_or_reference(ffi_impl: Callable[..., Any], reference: Callable[..., Any], *args: Any) -> Any:
    """Runs the C kernel on CPU and the pure-jnp reference on every other platform.

    Inside ``shard_map`` both branches must return the same types, including the mesh axes a
    value varies over, and an FFI call takes inputs that vary over the same axes and returns
    results that vary over none. Inputs and results are therefore made to vary over every axis
    any input varies over.
    """
    axes = frozenset().union(*(varying_axes(a) for a in jax.tree.leaves(args)))
    if not axes:
        return jax.lax.platform_dependent(*args, cpu=ffi_impl, default=reference)
    args = vary(args, axes)
    return jax.lax.platform_dependent(*args, cpu=lambda *a: vary(ffi_impl(*a), axes),
                                      default=lambda *a: vary(reference(*a), axes))


def vary(tree: Any, axes: frozenset) -> Any:
    """Every leaf of ``tree`` made to vary over the mesh axes ``axes`` too."""
    def cast(leaf: jax.Array) -> jax.Array:
        missing = tuple(sorted(axes - varying_axes(leaf)))
        return jax.lax.pcast(leaf, missing, to="varying") if missing else leaf
    return jax.tree.map(cast, tree)


def cond_varying(pred: Any, true_fun: Callable[..., Any], false_fun: Callable[..., Any], *operands: Any,
                 axes: frozenset = frozenset()) -> Any:
    """``jax.lax.cond`` whose branches' results vary over the mesh ``axes`` alike, as
    ``shard_map`` requires: a branch may compute from varying values where the other passes an
    invariant one through."""
    if not axes:
        return jax.lax.cond(pred, true_fun, false_fun, *operands)
    return jax.lax.cond(pred, lambda *a: vary(true_fun(*a), axes), lambda *a: vary(false_fun(*a), axes), *operands)


def check_vector(x: Any, name: str, dtype: Any = VALUE_DTYPE) -> jax.Array:
    """``x`` as a 1-D array of ``dtype`` (or of one of a tuple of dtypes); raises naming ``name`` otherwise."""
    x = jnp.asarray(x)
    if x.ndim != 1:
        raise ValueError(f"{name} must be a 1-D vector, got shape {x.shape}; flatten it with .ravel()")
    allowed = [jnp.dtype(d) for d in (dtype if isinstance(dtype, tuple) else (dtype,))]
    if x.dtype not in allowed:
        names = " or ".join(d.name for d in allowed)
        raise TypeError(f"{name} must have dtype {names}, got {x.dtype}; convert with .astype()")
    return x


def check_stream(s: Any, name: str) -> SparseStream:
    if not isinstance(s, SparseStream):
        raise TypeError(f"{name} must be a SparseStream, got {type(s).__name__}")
    if s.indices.ndim != 1 or s.values.ndim != 1 or jnp.shape(s.nnz) != () or not (
            s.values.shape == s.indices.shape or s.dense_by_construction):
        raise ValueError(
            f"{name}: indices and values must be 1-D of equal capacity (or, dense, no indices and size={s.size} "
            f"values) and nnz a scalar; got {s.indices.shape}, {s.values.shape}, {jnp.shape(s.nnz)}"
        )
    if s.indices.dtype != INDEX_DTYPE or s.values.dtype != VALUE_DTYPE:
        raise TypeError(f"{name}: indices must be int32 and values float32, got {s.indices.dtype}, {s.values.dtype}")
    # A traced count is checked by the C kernels that read the stream.
    known = isinstance(s.nnz, (int, np.integer, np.ndarray, jax.Array)) and not isinstance(s.nnz, jax.core.Tracer)
    if s.dense_by_construction and known and (count := int(np.asarray(s.nnz))) != s.size:
        raise ValueError(f"{name}: a stream without indices is dense: its nnz must be its size {s.size}, got "
                         f"{count}; build it with SparseStream.dense(x), or pass indices")
    return s


def check_same_size(a: SparseStream, b: SparseStream) -> None:
    if a.size != b.size:
        raise ValueError(f"streams a and b describe vectors of different sizes ({a.size} != {b.size})")


def scalar_i32(x: Any) -> jax.Array:
    return jnp.asarray(x, INDEX_DTYPE).reshape(())


def attr_i64(x: int) -> np.int64:
    return np.int64(x)


def valid_mask(s: SparseStream) -> jax.Array:
    return jnp.arange(s.capacity, dtype=INDEX_DTYPE) < s.nnz
