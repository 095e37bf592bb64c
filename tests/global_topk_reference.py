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


def spardl_reference(xs: list[np.ndarray], k: int, teams: int = 1):
    """(total as a dense vector, its sorted indices, every rank's residual). With ``teams``:
    Spar-Reduce-Scatter inside each team of P / teams consecutive ranks, then the owners of a
    block in every team sum their selections and keep the top kb of the sum."""
    p, n = len(xs), xs[0].size
    width = p // teams
    bounds = partition_bounds(n, width)
    block = [np.arange(bounds[q], bounds[q + 1]) for q in range(width)]
    budget = [math.ceil(k * b.size / n) if n else 0 for b in block]
    acc = [x.astype(np.float32).copy() for x in xs]
    rounds = math.ceil(math.log2(width)) if width > 1 else 0
    sizes = [2 ** i for i in range(rounds - 1)]
    if width - 2 ** (rounds - 1) > 0 and rounds:
        sizes.append(width - 2 ** (rounds - 1))
    gap = width - sizes[-1] if sizes else 0
    for size in sizes[::-1]:
        messages = []
        for r in range(p):
            team, q = divmod(r, width)
            for j in range(size):
                b = (q + gap + j) % width
                chosen = top(acc[r], block[b], budget[b])
                messages.append((team * width + (q + gap) % width, chosen, acc[r][chosen].copy()))
                acc[r][chosen] = 0.0
        for dest, chosen, values in messages:
            acc[dest][chosen] += values
        gap //= 2
    total = np.zeros(n, np.float32)
    support = []
    for q in range(width):
        summed = np.zeros(n, np.float32)
        union = []
        for r in range(q, p, width):  # the owners of block q, team by team
            chosen = top(acc[r], block[q], budget[q])
            summed[chosen] += acc[r][chosen]
            acc[r][chosen] = 0.0
            union.append(chosen)
        union = np.unique(np.concatenate(union))
        kept = top(summed, union, budget[q]) if teams > 1 else union
        total[kept] = summed[kept]
        support.append(kept)
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


def threshold_select(values: np.ndarray, positions: np.ndarray, threshold: float | None, cap: int) -> np.ndarray:
    """Ok-Topk's selection: the nonzero ``positions`` whose |values| reach ``threshold``, or,
    when more than ``cap`` do (or without a threshold), the ``cap`` largest."""
    if threshold is not None:
        v = values[positions]
        above = positions[(v != 0) & (np.abs(v) >= np.float32(threshold))]
        if above.size <= cap:
            return above
    return top(values, positions, cap)


def oktopk_reference(xs: list[np.ndarray], k: int, local_thresholds, global_threshold, starts, exact: bool):
    """(total as a dense vector, its sorted indices, every rank's residual) of one Ok-Topk step
    with the given thresholds (one per rank, and the global one) and region starts."""
    p, n = len(xs), xs[0].size
    if k >= n:
        local_cap = region_cap = n
    else:
        local_cap, region_cap = min(2 * k, n), min(math.ceil(2 * k / p), n)
    selected = [threshold_select(x, np.arange(n), t, local_cap) for x, t in zip(xs, local_thresholds)]
    bounds = np.maximum.accumulate(np.clip(np.concatenate([[0], np.asarray(starts, np.int64), [n]]), 0, n))
    total = np.zeros(n, np.float32)
    support = []
    for owner in range(p):
        lo, hi = bounds[owner], bounds[owner + 1]
        region = np.zeros(n, np.float32)
        for r in [owner] + [(owner - d) % p for d in range(1, p)]:  # the order in which the owner adds them
            mine = selected[r][(selected[r] >= lo) & (selected[r] < hi)]
            region[mine] += xs[r][mine]
        touched = np.unique(np.concatenate([s[(s >= lo) & (s < hi)] for s in selected]))
        kept = threshold_select(region, touched, None if exact else global_threshold, region_cap)
        total[kept] = region[kept]
        support.append(kept)
    support = np.sort(np.concatenate(support)) if support else np.zeros(0, np.int64)
    if exact:
        support = top(total, support, k)
        cut = np.zeros(n, np.float32)
        cut[support] = total[support]
        total = cut
    nonzero = total != 0
    residuals = []
    for x, chosen in zip(xs, selected):
        residual = x.astype(np.float32).copy()
        taken = np.zeros(n, bool)
        taken[chosen] = True
        residual[nonzero & taken] = 0.0
        residuals.append(residual)
    return total, support, residuals


def kth_magnitude(x: np.ndarray, k: int) -> np.float32:
    """The k-th largest |x| (0 when k = 0): Ok-Topk's exact threshold."""
    if k == 0 or x.size == 0:
        return np.float32(0)
    return np.sort(np.abs(x.astype(np.float32)))[::-1][min(k, x.size) - 1]


def balanced_starts(xs: list[np.ndarray], thresholds) -> np.ndarray:
    """Ok-Topk's region starts: every rank's selected indices sampled at ranks count i / P, averaged."""
    p, n = len(xs), xs[0].size
    samples = []
    for x, t in zip(xs, thresholds):
        chosen = np.flatnonzero((x != 0) & (np.abs(x) >= np.float32(t)))
        if chosen.size >= p:
            samples.append(chosen[(chosen.size // p) * np.arange(1, p)])
        else:
            samples.append(partition_bounds(n, p)[1:-1].astype(np.int64))
    samples = np.asarray(samples, np.int64)
    return (samples // p).sum(0) + (samples % p).sum(0) // p


def moved(threshold, selected: int, k: int, raise_by: float, lower_by: float) -> np.float32:
    t = np.float32(threshold)
    if selected < 0.8 * k:
        return t / np.float32(lower_by)
    if selected > 1.25 * k:
        return t * np.float32(raise_by)
    return t


def oktopk_step_reference(xs: list[np.ndarray], k: int, state: dict, tau: int = 128, tau_prime: int = 64):
    """One call of Ok-Topk with every rank's state (step, local thresholds, global threshold,
    starts): (total, support, residuals, next state)."""
    p = len(xs)
    exact = state["step"] % tau == 0
    local = [kth_magnitude(x, k) for x in xs] if exact else list(state["local"])
    starts = balanced_starts(xs, local) if state["step"] % tau_prime == 0 and p > 1 else np.asarray(state["starts"])
    total, support, residuals = oktopk_reference(xs, k, local, state["global"], starts, exact)
    if exact:  # the k-th largest of the result
        global_threshold = np.abs(total[support]).min() if support.size else np.float32(0)
    else:
        global_threshold = moved(state["global"], support.size, k, 1.025, 1.036)
    selected = [int(np.count_nonzero((x != 0) & (np.abs(x) >= np.float32(t)))) for x, t in zip(xs, local)]
    following = {"step": state["step"] + 1, "local": [moved(t, c, k, 1.025, 1.025) for t, c in zip(local, selected)],
                 "global": global_threshold, "starts": starts}
    return total, support, residuals, following


def initial_oktopk_state(p: int) -> dict:
    return {"step": 0, "local": [np.float32(0)] * p, "global": np.float32(0), "starts": np.zeros(p - 1, np.int64)}
