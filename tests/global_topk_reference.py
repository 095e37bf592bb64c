"""Plain numpy references of the global top-k schedules, written from the papers' pseudo-code
(SparDL's public ``allreducer.py``; gTop-k's tree), independent of the transport operations:
dense accumulators and explicit index sets. Every rank's result and residual come back."""

from __future__ import annotations

import math

import numpy as np

from sparcml_jax import partition_bounds


def top(values: np.ndarray, positions: np.ndarray, k: int) -> np.ndarray:
    """The k of ``positions`` whose ``values`` are largest in magnitude, ties to the lower
    position (``sparcml_jax.topk``'s order on the IEEE bits of |v|), sorted."""
    key = (values[positions].astype(np.float32).view(np.uint32) & np.uint32(0x7FFFFFFF)).astype(np.int64)
    return np.sort(positions[np.lexsort((positions, -key))][:k])


def spardl_reference(xs: list[np.ndarray], k: int):
    """(total as a dense vector, its sorted indices, every rank's residual)."""
    p, n = len(xs), xs[0].size
    bounds = partition_bounds(n, p)
    block = [np.arange(bounds[q], bounds[q + 1]) for q in range(p)]
    budget = [math.ceil(k * b.size / n) if n else 0 for b in block]
    acc = [x.astype(np.float32).copy() for x in xs]
    rounds = math.ceil(math.log2(p)) if p > 1 else 0
    sizes = [2 ** i for i in range(rounds - 1)]
    if p - 2 ** (rounds - 1) > 0 and rounds:
        sizes.append(p - 2 ** (rounds - 1))
    gap = p - sizes[-1] if sizes else 0
    for size in sizes[::-1]:
        messages = []
        for r in range(p):
            for j in range(size):
                b = (r + gap + j) % p
                chosen = top(acc[r], block[b], budget[b])
                messages.append(((r + gap) % p, chosen, acc[r][chosen].copy()))
                acc[r][chosen] = 0.0
        for dest, chosen, values in messages:
            acc[dest][chosen] += values
        gap //= 2
    total = np.zeros(n, np.float32)
    support = []
    for r in range(p):
        chosen = top(acc[r], block[r], budget[r])
        total[chosen] = acc[r][chosen]
        acc[r][chosen] = 0.0
        support.append(chosen)
    support = np.concatenate(support) if support else np.zeros(0, np.int64)
    residuals = []
    nonzero = total != 0
    for x, held in zip(xs, acc):
        residual = x.astype(np.float32).copy()
        residual[nonzero] = held[nonzero]
        residuals.append(residual)
    return total, np.sort(support), residuals


def gtopk_reference(xs: list[np.ndarray], k: int):
    """(total as a dense vector, its sorted indices, every rank's residual)."""
    p, n = len(xs), xs[0].size
    residuals = [x.astype(np.float32).copy() for x in xs]
    kept = []
    for r in range(p):
        chosen = top(residuals[r], np.arange(n), k)
        kept.append({int(i): residuals[r][i] for i in chosen})
        residuals[r][chosen] = 0.0
    distance = 1
    while distance < p:
        for child in range(distance, p, 2 * distance):
            parent = child - distance
            merged = dict(kept[parent])
            for i, v in kept[child].items():
                merged[i] = np.float32(merged.get(i, np.float32(0)) + v)
            kept[child] = {}
            positions = np.array(sorted(merged), np.int64)
            values = np.zeros(n, np.float32)
            values[positions] = [merged[i] for i in positions]
            chosen = set(top(values, positions, k).tolist())
            for i in positions:
                if int(i) not in chosen:
                    residuals[parent][i] += merged[int(i)]
            kept[parent] = {i: merged[i] for i in chosen}
        distance *= 2
    total = np.zeros(n, np.float32)
    support = np.array(sorted(kept[0]), np.int64)
    total[support] = [kept[0][i] for i in support]
    return total, support, residuals
