"""Sparsifiers: which k entries of (gradient + residual) a rank sends.

A sparsifier is any callable ``(v, k, key) -> SparseStream`` returning at most ``k`` entries of
the 1-D float32 vector ``v`` with their exact values (capacity ``k``). The error-feedback
residual keeps whatever it leaves out, so any choice is safe; it only changes how fast the
residual drains.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from sparcml_jax.kernels.partition import gather
from sparcml_jax.kernels.topk import topk as _topk
from sparcml_jax.stream import INDEX_DTYPE, VALUE_DTYPE, SparseStream

Sparsifier = Callable[[jax.Array, int, jax.Array], SparseStream]


def topk(v: jax.Array, k: int, key: jax.Array | None = None) -> SparseStream:
    """The k entries of largest magnitude (Strom 2015; Dryden et al. 2016; SparCML §5)."""
    del key
    return _topk(v, k)


def randomk(v: jax.Array, k: int, key: jax.Array) -> SparseStream:
    """k entries chosen at random, one uniformly in each of k equal strata of the index space.

    Stratifying keeps the indices sorted and distinct without a sort, and gives every index the
    same probability (up to the last stratum's remainder).
    """
    n = v.shape[0]
    if k == 0:
        return SparseStream.empty(n, 0)
    width = n // k
    offsets = jax.random.randint(key, (k,), 0, width, dtype=INDEX_DTYPE)
    last_extra = jax.random.randint(jax.random.fold_in(key, 1), (), 0, n - width * (k - 1), dtype=INDEX_DTYPE)
    offsets = offsets.at[k - 1].set(last_extra)
    indices = jnp.arange(k, dtype=INDEX_DTYPE) * width + offsets
    return gather(v, indices, jnp.int32(k))


def threshold(tau: float) -> Sparsifier:
    """Entries with ``|v| >= tau``, at most k of them (the largest if more qualify)."""

    def select(v: jax.Array, k: int, key: jax.Array | None = None) -> SparseStream:
        s = _topk(v, k)
        keep = (jnp.abs(s.values) >= tau) & (jnp.arange(s.capacity) < s.nnz)
        position = jnp.where(keep, jnp.cumsum(keep) - 1, s.capacity)
        indices = jnp.full((s.capacity,), s.size, INDEX_DTYPE).at[position].set(s.indices, mode="drop")
        values = jnp.zeros((s.capacity,), VALUE_DTYPE).at[position].set(s.values, mode="drop")
        return SparseStream(indices, values, jnp.sum(keep, dtype=INDEX_DTYPE), s.size)

    return select


SPARSIFIERS: dict[str, Sparsifier] = {"topk": topk, "randomk": randomk}


def resolve(sparsifier: str | Sparsifier) -> Sparsifier:
    if callable(sparsifier):
        return sparsifier
    if sparsifier == "threshold":
        raise ValueError("sparsifier='threshold' needs a value: pass sparsifier=sparcml_jax.sparsifiers.threshold(tau)")
    if sparsifier not in SPARSIFIERS:
        raise ValueError(f"sparsifier must be one of {sorted(SPARSIFIERS)} or a callable (v, k, key) -> SparseStream, "
                         f"got {sparsifier!r}")
    return SPARSIFIERS[sparsifier]
