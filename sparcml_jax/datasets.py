"""Data sets for the examples: the paper's URL classification task (SparCML §8.2) in miniature.

:func:`synthetic_url` generates, deterministically from a seed and in seconds, a binary
classification set with the statistics that make URL a sparse-communication workload: millions
of binary features, about a hundred active per sample, power-law feature frequencies and a
planted sparse linear model. :func:`load_svmlight` reads the real thing (``url_combined``) or any
svmlight/libsvm file.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class SparseDataset(NamedTuple):
    """Samples as padded rows: ``ids[i, j]`` is a feature of sample i (``num_features`` marks
    padding) with value ``vals[i, j]`` (0 on padding); ``labels`` are 0/1."""

    ids: np.ndarray
    vals: np.ndarray
    labels: np.ndarray
    num_features: int

    def __len__(self) -> int:
        return len(self.labels)

    def shard(self, rank: int, nprocs: int) -> "SparseDataset":
        """Rank's contiguous share (every rank gets the same count; the remainder is dropped)."""
        per = len(self) // nprocs
        sl = slice(rank * per, (rank + 1) * per)
        return SparseDataset(self.ids[sl], self.vals[sl], self.labels[sl], self.num_features)

    def split(self, test_fraction: float) -> tuple["SparseDataset", "SparseDataset"]:
        cut = int(len(self) * (1 - test_fraction))
        head = SparseDataset(self.ids[:cut], self.vals[:cut], self.labels[:cut], self.num_features)
        tail = SparseDataset(self.ids[cut:], self.vals[cut:], self.labels[cut:], self.num_features)
        return head, tail


def synthetic_url(num_samples: int = 120_000, num_features: int = 1 << 22, mean_active: int = 100,
                  max_active: int = 160, model_nnz: int = 20_000, zipf_exponent: float = 1.0,
                  positive_fraction: float = 0.33, seed: int = 0) -> SparseDataset:
    """A URL-like data set (defaults: 4M features, about 100 binary features per sample).

    Feature popularity follows a power law ``p(j) ~ 1 / j**zipf_exponent`` over a random
    permutation of the ids; labels come from a planted model with ``model_nnz`` nonzero weights
    on popular and rare features alike, plus logistic noise, thresholded so that about
    ``positive_fraction`` of the samples are positive (URL: about a third are malicious).
    """
    rng = np.random.default_rng(seed)
    permutation = rng.permutation(num_features).astype(np.int32)
    counts = np.clip(rng.poisson(mean_active, num_samples), 1, max_active)
    ranks = _power_law_ranks(rng, counts.sum(), num_features, zipf_exponent)
    ids = np.full((num_samples, max_active), num_features, np.int32)
    rows = np.repeat(np.arange(num_samples), counts)
    cols = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    ids[rows, cols] = permutation[ranks]
    ids.sort(axis=1)  # duplicates (rare) are harmless: a feature counted twice has value 2
    vals = (ids < num_features).astype(np.float32)

    # The planted weights sit on features drawn by the same popularity law, so they are learnable.
    support = np.unique(permutation[_power_law_ranks(rng, 4 * model_nnz, num_features, zipf_exponent)])[:model_nnz]
    weights = np.zeros(num_features + 1, np.float32)
    weights[support] = rng.standard_normal(model_nnz).astype(np.float32) * 2.0
    margin = (weights[ids] * vals).sum(axis=1) + rng.logistic(size=num_samples).astype(np.float32)
    labels = (margin > np.quantile(margin, 1 - positive_fraction)).astype(np.float32)
    return SparseDataset(ids, vals, labels, num_features)


def _power_law_ranks(rng: np.random.Generator, count: int, n: int, exponent: float) -> np.ndarray:
    """Popularity ranks in [0, n) with ``p(j) ~ (j + 1) ** -exponent`` (inverse CDF of the continuous law)."""
    u = rng.random(count)
    if exponent == 1.0:
        x = np.exp(u * np.log(n + 1.0))
    else:
        a = 1.0 - exponent
        x = (1.0 + u * ((n + 1.0) ** a - 1.0)) ** (1.0 / a)
    return np.minimum(x.astype(np.int64) - 1, n - 1).clip(0)


def load_svmlight(path: str, num_features: int | None = None) -> SparseDataset:
    """Reads an svmlight/libsvm file (e.g. ``url_combined``); labels <= 0 become 0, others 1."""
    from sklearn.datasets import load_svmlight_file

    x, y = load_svmlight_file(path, n_features=num_features, dtype=np.float32)
    x = x.tocsr()
    x.sort_indices()
    n, width = x.shape[1], max(int(np.diff(x.indptr).max()), 1)
    ids = np.full((x.shape[0], width), n, np.int32)
    vals = np.zeros((x.shape[0], width), np.float32)
    lengths = np.diff(x.indptr)
    rows = np.repeat(np.arange(x.shape[0]), lengths)
    cols = np.arange(x.nnz) - np.repeat(x.indptr[:-1], lengths)
    ids[rows, cols] = x.indices
    vals[rows, cols] = x.data
    return SparseDataset(ids, vals, (y > 0).astype(np.float32), n)
