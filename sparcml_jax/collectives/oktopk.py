"""Ok-Topk (Li and Hoefler, PPoPP'22, §3): a threshold selection, a sparse reduce-scatter over
balanced regions, a global threshold and an allgather of what passes it.

Every rank selects the entries of its accumulator ``x`` (gradient plus residual) of at least its
local threshold. The index space is cut into P regions whose boundaries balance the selected
indices (the caller computes ``starts``); in rounds d = 1, ..., P - 1 every rank r hands its
selection in region r + d to that region's owner (a rotated order, so that no rank receives
twice in a round) and rank r ends with region r summed. The owner keeps the entries of at least
the global threshold and the results are allgathered. A step that re-evaluates the thresholds
(``exact``) keeps every owner's largest entries instead and then the k largest of their union,
from which the caller reads the new global threshold.

The residual is ``x`` except where the result is nonzero, where it is what the rank did not
select: what a rank selected but the owner dropped stays with every rank that put it in, so
``total + sum_r residual_r == sum_r x_r`` exactly. At most k entries after a re-evaluation, at
most P ceil(2k / P) <= 2k + P otherwise (:func:`~sparcml_jax.comm.topology.oktopk_capacities`).
"""

from __future__ import annotations

from typing import Any

from sparcml_jax.comm import S, Transport
from sparcml_jax.comm.topology import oktopk_capacities


def oktopk(t: Transport[S], x: S, *, k: int, local_threshold: Any, global_threshold: Any, starts: Any,
           exact: bool) -> tuple[S, S]:
    selected_capacity, region_budget = oktopk_capacities(k, t.size, t.nprocs)
    selected, rest = t.select(x, selected_capacity, threshold=local_threshold)
    regions = t.split_regions(selected, starts)
    for distance in range(1, t.nprocs):  # rank r hands region r + distance to its owner
        regions = t.pass_blocks(regions, distance=distance, count=1)
    owned, _ = t.select_owned(regions, [region_budget] * t.nprocs, threshold=None if exact else global_threshold)
    total = t.allgather(owned)
    if exact:
        total, _ = t.select(total, k)
    return total, t.residual(x, rest, total)
