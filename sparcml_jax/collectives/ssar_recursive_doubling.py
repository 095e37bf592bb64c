"""SSAR_Recursive_double (SparCML §5.2, Algorithm 1): log2 P rounds of exchange + merge.

Best for small data: latency ``log P * alpha``; bandwidth between ``k log P`` (identical
supports) and ``k (P - 1)`` pairs (disjoint supports). A non-power of two P first folds the
``P - P'`` extra ranks into the lower power of two ``P'`` and unfolds the result after.
"""

from __future__ import annotations

from sparcml_jax.comm import S, Transport
from sparcml_jax.comm.topology import lower_power_of_two


def ssar_recursive_doubling(t: Transport[S], s: S) -> S:
    lower = lower_power_of_two(t.nprocs)
    extra = t.nprocs - lower
    if extra:  # fold: rank P' + i adds its stream into rank i's
        s = t.exchange(s, [(lower + i, i) for i in range(extra)], combine="add")
    distance = 1
    while distance < lower:  # partners at distance 1, 2, 4, ... swap their sums and add them
        s = t.exchange(s, [(r, r ^ distance) for r in range(lower)], combine="add")
        distance *= 2
    if extra:  # unfold: rank i hands the total to rank P' + i
        s = t.exchange(s, [(i, lower + i) for i in range(extra)], combine="replace")
    return s
