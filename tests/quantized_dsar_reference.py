"""The reference of quantized DSAR (both phases coded), written from the wire format's
specification with the pure-jnp QSGD reference, independent of the transports: every coding's
key, the float32 sums in rank order and the codes of each range padded to the longest range."""

from __future__ import annotations

import functools
from typing import Callable

import jax
import numpy as np

from sparcml_jax import partition_bounds, qsgd_dequantize_reference, qsgd_quantize_reference
from sparcml_jax.kernels.qsgd import key_words, segment_key


# Compiled: P (P - 1) + P codings per reference, op by op, took seconds per call at P = 8.
@functools.partial(jax.jit, static_argnames=("bits", "bucket", "scale"))
def _decoded_codes(x, key, bits: int, bucket: int, scale: str):
    return qsgd_dequantize_reference(qsgd_quantize_reference(x, key, bits=bits, bucket_size=bucket, scale=scale))


def _coded(x: np.ndarray, key, bits: int, bucket: int, scale: str) -> np.ndarray:
    return np.asarray(_decoded_codes(x, key, bits=bits, bucket=bucket, scale=scale))


def split_phase_error(rows: np.ndarray, rank: int, key, *, bits: int, bucket: int, scale: str = "max",
                      coded: Callable[[int, int], bool] = lambda r, o: True) -> np.ndarray:
    """What rank ``rank``'s split phase lost (``quantize_feedback``): over every range o it sent
    coded, its segment minus the decoded codes (float32), zeros elsewhere."""
    p, n = rows.shape
    bounds = partition_bounds(n, p)
    out = np.zeros(n, np.float32)
    for o in range(p):
        lo, hi = int(bounds[o]), int(bounds[o + 1])
        if o != rank and coded(rank, o) and hi > lo:
            segment = rows[rank, lo:hi].astype(np.float32)
            words = key_words(jax.random.fold_in(key, rank))
            out[lo:hi] = segment - _coded(segment, segment_key(words, o), bits, bucket, scale)
    return out


def quantized_dsar_reference(rows: np.ndarray, key, *, bits: int, bucket: int, scale: str = "max",
                             coded: Callable[[int, int], bool] = lambda r, o: True) -> np.ndarray:
    """The sum every rank holds after quantized DSAR over ``rows`` (one float32 row per rank).

    Split phase: rank r's segment for range o (r != o) is decoded from its codes under
    ``segment_key(key_words(fold_in(key, r)), o)`` when ``coded(r, o)``, else exact; owner o adds
    the segments in rank order in float32. Allgather phase: owner o's sum, zero-padded to the
    longest range, is decoded from its codes under ``fold_in(key, o)``."""
    p, n = rows.shape
    bounds = partition_bounds(n, p)
    longest = int(max(np.diff(bounds), default=0))
    out = np.zeros(n, np.float32)
    for o in range(p):
        lo, hi = int(bounds[o]), int(bounds[o + 1])
        total = np.zeros(hi - lo, np.float32)
        for r in range(p):
            segment = rows[r, lo:hi].astype(np.float32)
            if r != o and coded(r, o) and hi > lo:
                segment = _coded(segment, segment_key(key_words(jax.random.fold_in(key, r)), o), bits, bucket, scale)
            total = total + segment
        padded = np.concatenate([total, np.zeros(longest - (hi - lo), np.float32)])
        if longest:
            out[lo:hi] = _coded(padded, jax.random.fold_in(key, o), bits, bucket, scale)[:hi - lo]
    return out
