"""The sparse stream: SparCML's unit of communication (paper §3, "sparse streams").

A stream holds ``nnz`` sorted (index, value) pairs of a length-``size`` vector in buffers of a
static ``capacity``. Entries past ``nnz`` are padding (index ``size``, value 0). When the pairs
would cost at least as much as the dense vector, ``nnz * (4 + 4) >= delta * size * 4``, the
stream switches to its dense representation: ``nnz == size`` and ``values[i]`` is entry ``i``;
no kernel reads its indices. The switch needs ``capacity >= size``; every kernel decides it on
the actual count.

A stream that is dense by construction (:meth:`SparseStream.dense`, the result of a dense
allreduce) has no index array at all: ``indices`` is empty and ``values`` holds the ``size``
values. It is stored, sent and summed as the dense vector it is.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

INDEX_DTYPE = jnp.int32
VALUE_DTYPE = jnp.float32
INDEX_BYTES = 4
VALUE_BYTES = 4
MAX_SIZE = np.iinfo(np.int32).max


def check_size(size: int, name: str = "size") -> int:
    """Validates a dense length: a non-negative Python int that fits int32 indices."""
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)):
        raise TypeError(f"{name} must be a Python int (the static dense length), got {type(size).__name__}")
    size = int(size)
    if not 0 <= size <= MAX_SIZE:
        raise ValueError(
            f"{name}={size} does not fit int32 indices: it must lie in [0, {MAX_SIZE}]; "
            "split the vector into several streams"
        )
    return size


def dense_threshold(size: int, delta: float = 1.0) -> int:
    """Smallest nnz at which the dense representation is no larger than the pairs.

    SparCML's rule: dense once ``nnz * (index_bytes + value_bytes) >= delta * size * value_bytes``.
    """
    if not delta > 0:
        raise ValueError(f"delta must be positive (1.0 is SparCML's rule), got {delta}")
    return max(1, math.ceil(delta * size * VALUE_BYTES / (INDEX_BYTES + VALUE_BYTES)))


def can_switch_to_dense(capacity: int, size: int, delta: float) -> bool:
    """Whether a stream of ``capacity`` pairs may need the dense representation."""
    return min(capacity, size) >= dense_threshold(size, delta)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SparseStream:
    """Sorted (index, value) pairs of a length-``size`` vector, or that vector itself.

    Attributes:
      indices: int32[capacity], strictly increasing in ``[0, size)`` for the first ``nnz``; or
        int32[0] for a stream dense by construction (``values`` float32[size], ``nnz == size``).
      values: float32[capacity], the matching values.
      nnz: int32 scalar, the number of valid pairs; ``nnz == size`` marks the dense form.
      size: static dense length N.

    Example:
      >>> import jax.numpy as jnp
      >>> from sparcml_jax import SparseStream
      >>> s = SparseStream.from_dense(jnp.array([0., 3., 0., 0., 0., -1.]), capacity=4)
      >>> s.indices.tolist(), s.values.tolist(), int(s.nnz)
      ([1, 5, 6, 6], [3.0, -1.0, 0.0, 0.0], 2)
      >>> s.to_dense().tolist()
      [0.0, 3.0, 0.0, 0.0, 0.0, -1.0]
    """

    indices: jax.Array
    values: jax.Array
    nnz: jax.Array
    size: int = dataclasses.field(metadata=dict(static=True))

    def __post_init__(self):
        # Leaves can be placeholders inside JAX transformations: check only real arrays.
        for name, want in (("indices", INDEX_DTYPE), ("values", VALUE_DTYPE), ("nnz", INDEX_DTYPE)):
            leaf = getattr(self, name)
            dtype = getattr(leaf, "dtype", None)
            if dtype is not None and dtype != want:
                raise TypeError(
                    f"SparseStream.{name} must have dtype {jnp.dtype(want).name}, got {dtype}; "
                    f"convert with .astype(jnp.{jnp.dtype(want).name})"
                )

    @property
    def capacity(self) -> int:
        return self.values.shape[-1]

    @property
    def dense_by_construction(self) -> bool:
        """Static: the stream is its ``size`` values with no index array (see :meth:`dense`)."""
        return self.indices.shape[-1] == 0 and self.values.shape[-1] == self.size

    @property
    def is_dense(self) -> jax.Array:
        """Traced bool: whether the stream is in its dense representation."""
        return self.nnz == self.size

    @classmethod
    def dense(cls, x: jax.Array) -> "SparseStream":
        """The dense representation of a float32[size] vector, without an index array: what a
        dense allreduce takes and returns as it is (no copy, no indices written or sent).

        Example:
          >>> import jax.numpy as jnp
          >>> from sparcml_jax import SparseStream
          >>> s = SparseStream.dense(jnp.array([0., 3., 0., -1.]))
          >>> s.indices.shape, int(s.nnz), s.dense_by_construction, s.to_dense().tolist()
          ((0,), 4, True, [0.0, 3.0, 0.0, -1.0])
        """
        x = jnp.asarray(x)
        if x.ndim != 1 or x.dtype != VALUE_DTYPE:
            raise ValueError(f"SparseStream.dense takes a 1-D float32 vector, got {x.dtype}{list(x.shape)}; "
                             "pass x.ravel().astype(jnp.float32)")
        return dense_stream(x)

    @classmethod
    def empty(cls, size: int, capacity: int) -> "SparseStream":
        size = check_size(size)
        return cls(
            indices=jnp.full((capacity,), size, INDEX_DTYPE),
            values=jnp.zeros((capacity,), VALUE_DTYPE),
            nnz=jnp.zeros((), INDEX_DTYPE),
            size=size,
        )

    @classmethod
    def from_dense(cls, x: jax.Array, capacity: int | None = None, delta: float = 1.0) -> "SparseStream":
        """The nonzeros of a 1-D float32 vector (NaN counts as nonzero, -0.0 as zero).

        With ``capacity=None`` the capacity is ``x.size`` and the stream is dense when the count
        reaches the threshold. More nonzeros than ``capacity`` give a stream with ``nnz`` above
        its capacity, which every consumer rejects (see :func:`sparcml_jax.from_dense`).
        """
        return _conversions["from_dense"](x, capacity=capacity, delta=delta)

    def to_dense(self) -> jax.Array:
        """The float32[size] vector this stream represents (an invalid stream raises). A stream
        dense by construction is its values: a count other than its size raises where the count
        is known while tracing, and in every kernel that reads the stream."""
        return _conversions["to_dense"](self)

    def wire_bytes(self) -> jax.Array:
        """Bytes this stream costs on the wire: the valid pairs, or the dense values."""
        return jnp.where(self.is_dense, self.size * VALUE_BYTES, self.nnz * (INDEX_BYTES + VALUE_BYTES))


# The conversions are kernels (sparcml_jax.kernels.partition: C on CPU, jnp elsewhere, validated),
# which depend on this type; they install themselves here when the package is imported.
_conversions: dict[str, Callable] = {}


def install_conversions(*, from_dense: Callable, to_dense: Callable) -> None:
    """Makes :meth:`SparseStream.from_dense` and :meth:`SparseStream.to_dense` use these kernels."""
    _conversions.update(from_dense=from_dense, to_dense=to_dense)


def dense_stream(values: jax.Array) -> SparseStream:
    """The dense representation of a float32[size] vector, with no index array (``nnz == size``)."""
    n = values.shape[0]
    return SparseStream(jnp.zeros((0,), INDEX_DTYPE), values, jnp.asarray(n, INDEX_DTYPE), n)


def with_indices(s: SparseStream) -> SparseStream:
    """``s`` in buffers of pairs (index and value buffers of equal capacity), for the operations
    that may turn a dense stream into pairs. A stream dense by construction gets indices 0..size-1
    (shifted out of range if its nnz is not its size, so that the kernels reject it)."""
    if not s.dense_by_construction or s.size == 0:
        return s
    shift = jnp.where(s.nnz == s.size, 0, s.size).astype(INDEX_DTYPE)
    indices = jnp.arange(s.size, dtype=INDEX_DTYPE) + shift
    return SparseStream(indices, s.values, s.nnz, s.size)


def resize(s: SparseStream, capacity: int) -> SparseStream:
    """Pads or truncates the buffers to ``capacity`` (the caller guarantees nnz fits)."""
    if s.dense_by_construction and capacity == s.capacity:
        return s
    s = with_indices(s)
    extra = capacity - s.capacity
    if extra >= 0:
        return SparseStream(
            jnp.concatenate([s.indices, jnp.full((extra,), s.size, INDEX_DTYPE)]),
            jnp.concatenate([s.values, jnp.zeros((extra,), VALUE_DTYPE)]),
            s.nnz,
            s.size,
        )
    return SparseStream(s.indices[:capacity], s.values[:capacity], s.nnz, s.size)


def append_dense(s: SparseStream, tail: jax.Array) -> SparseStream:
    """``s`` followed by every entry of the float32 vector ``tail``: a stream of size
    ``s.size + m`` whose last ``m`` entries are ``tail``'s. Their pairs follow ``s``'s valid pairs
    (so they stay sorted); a stream in the dense representation stays dense. An invalid ``s`` (a
    count past its capacity) stays invalid."""
    n, m = s.size, tail.shape[0]
    size = check_size(n + m)
    if s.dense_by_construction:
        return dense_stream(jnp.concatenate([s.values, tail]))
    valid = jnp.arange(s.capacity) < s.nnz
    indices = jnp.concatenate([jnp.where(valid, s.indices, size), jnp.full((m,), size, INDEX_DTYPE)])
    indices = lax.dynamic_update_slice(indices, jnp.arange(n, size, dtype=INDEX_DTYPE), (s.nnz,))
    values = lax.dynamic_update_slice(jnp.concatenate([s.values, jnp.zeros((m,), VALUE_DTYPE)]), tail, (s.nnz,))
    return SparseStream(indices, values, s.nnz + m, size)
