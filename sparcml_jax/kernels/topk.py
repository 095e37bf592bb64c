"""Top-k magnitude selection: the sparsifier in front of the sparse collectives (SparCML §5)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from sparcml_jax import _lib
from sparcml_jax.kernels._common import attr_i64, check_vector, on_cpu_or_reference
from sparcml_jax.stream import INDEX_DTYPE, VALUE_DTYPE, SparseStream, check_size

_TARGET = "sparcml_topk"


def topk(x: jax.Array, k: int) -> SparseStream:
    r"""The ``k`` entries of ``x`` of largest magnitude, as a sparse stream sorted by index.

    Top-k sparsification (SparCML §5; with error feedback, each rank sends ``topk(g + r, k)`` and
    keeps ``g + r - topk(g + r, k).to_dense()`` as its next residual). With the magnitude key

    .. math::  \kappa(x_i) = \mathrm{bits}(x_i) \,\&\, \mathtt{0x7fffffff}
               \quad (\text{the IEEE-754 pattern of } |x_i| \text{ read as an unsigned integer}),

    order the entries by :math:`(-\kappa(x_i), i)` and keep the first ``k``: the selected set
    :math:`S` has :math:`|S| = k` and :math:`\kappa(x_i) > \kappa(x_j)`, or
    :math:`\kappa(x_i) = \kappa(x_j)` and :math:`i < j`, for every :math:`i \in S, j \notin S`.
    The result has ``indices = sorted(S)`` (strictly increasing), ``values = x[indices]`` with
    their original signs, ``nnz = k`` and capacity ``k``; with ``k == len(x)`` it is the dense
    representation. Selection is exact and deterministic:

    - ties in magnitude go to the lower index;
    - ``-0.0`` and ``0.0`` tie;
    - ``+-inf`` rank above every finite value, and NaN above ``+-inf`` (NaNs among themselves by
      payload bits): NaN entries are selected before any number, so a NaN gradient is sent (and
      shows up in the sum) rather than hidden in the residual.

    On CPU this is a C radix selection (no sort: histograms of the key bits find the exact
    threshold, usually reading ``x`` about once; ``vmap`` makes one call over all rows),
    elsewhere :func:`topk_reference`.

    Args:
      x: 1-D float32 vector of length ``n < 2**31``.
      k: static Python int in ``[0, n]``.

    Example:
      >>> import jax.numpy as jnp
      >>> from sparcml_jax.kernels.topk import topk
      >>> x = jnp.array([0.5, -3.0, 0.0, 2.0, -2.0, 1.0])
      >>> s = topk(x, 3)
      >>> s.indices.tolist(), s.values.tolist(), int(s.nnz)
      ([1, 3, 4], [-3.0, 2.0, -2.0], 3)
      >>> topk(x, 2).indices.tolist()  # |2.0| == |-2.0|: the lower index wins
      [1, 3]
      >>> (x - s.to_dense()).tolist()  # the residual kept for error feedback
      [0.5, 0.0, 0.0, 0.0, 0.0, 1.0]
    """
    x, k = _check_args(x, k)

    def ffi_impl(x):
        _lib.register_cpu_target(_TARGET, "SparcmlTopk")
        out = (jax.ShapeDtypeStruct((k,), INDEX_DTYPE), jax.ShapeDtypeStruct((k,), VALUE_DTYPE))
        return jax.ffi.ffi_call(_TARGET, out, vmap_method="broadcast_all")(x, k=attr_i64(k))

    def reference(x):
        return _select_jnp(x, k)

    indices, values = on_cpu_or_reference(ffi_impl, reference, x)
    return SparseStream(indices, values, jnp.asarray(k, INDEX_DTYPE), x.shape[0])


def topk_reference(x: jax.Array, k: int) -> SparseStream:
    """Pure-jnp :func:`topk` (same validation, same result bit for bit): ``lax.top_k`` on the key."""
    x, k = _check_args(x, k)
    indices, values = _select_jnp(x, k)
    return SparseStream(indices, values, jnp.asarray(k, INDEX_DTYPE), x.shape[0])


def _select_jnp(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    # The key fits in 31 bits, so its int32 order is its unsigned order; lax.top_k breaks ties
    # towards the lower index, which is exactly the kernel's rule.
    key = jax.lax.bitcast_convert_type(x, jnp.int32) & jnp.int32(0x7FFFFFFF)
    _, chosen = jax.lax.top_k(key, k)
    indices = jnp.sort(chosen).astype(INDEX_DTYPE)
    return indices, x[indices]


def _check_args(x, k) -> tuple[jax.Array, int]:
    x = check_vector(x, "x")
    n = check_size(x.shape[0], "len(x)")
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
        raise TypeError(
            f"k must be a static Python int (the output capacity), got {type(k).__name__}; "
            "under jax.jit mark it static, e.g. jax.jit(topk, static_argnums=1)"
        )
    k = int(k)
    if not 0 <= k <= n:
        raise ValueError(f"k={k} must lie in [0, len(x)={n}]; clip it, e.g. k=min(k, x.size)")
    return x, k
