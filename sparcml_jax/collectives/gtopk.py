"""gTop-k (Shi et al., ICDCS 2019): a tree of merges that keeps the top k of each, then a broadcast.

Every rank selects its top k. In ceil(log2 P) rounds of a binomial tree (any P) half of the
remaining ranks hand their k pairs to a partner, which adds them to its own and keeps the top k
of the sum; rank 0 ends with the result (k entries) and broadcasts it down the same tree.
Volume O(k log P), latency 2 log P rounds.

As published, a value dropped at an inner merge is lost. Here every value a rank drops, at its
first selection or at a merge, goes to that rank's residual, so
``total + sum_r residual_r == sum_r x_r`` exactly.
"""

from __future__ import annotations

from sparcml_jax.comm import S, Transport
from sparcml_jax.comm.topology import tree_rounds


def gtopk(t: Transport[S], x: S, *, k: int) -> tuple[S, S]:
    kept, residual = t.select(x, k)
    rounds = tree_rounds(t.nprocs)
    for pairs in rounds:  # a child hands its top k over; its parent keeps the top k of the sum
        merged = t.exchange(kept, pairs, combine="add", keep=False)
        kept, dropped = t.select(merged, k)
        residual = t.add(residual, dropped)
    for pairs in reversed(rounds):  # rank 0's result travels back down the tree
        kept = t.exchange(kept, [(parent, child) for child, parent in pairs], combine="replace")
    return kept, residual
