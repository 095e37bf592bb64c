"""SparDL's global top-k allreduce (arXiv 2304.00737, §4): Spar-Reduce-Scatter, Spar-All-Gather
and global residual collection.

Every rank's accumulated gradient x_r (gradient plus residual) is cut into P blocks. In
ceil(log2 P) rounds (at distances 2^(n-1), ..., 2, 1) every rank sends P - 1 blocks in all, each
re-selected to its budget kb right before it is sent (about k / P entries) and added into the
receiver's dense block; what was not selected stays with the sender. Rank r ends owning block
r summed over every rank, keeps its top kb, and the owned blocks are allgathered: the result has
at most k + P entries whatever P is, and every rank sends (P - 1) kb pairs in the first phase.

With ``teams`` G > 1 (SparDL's Spar-All-Gather) the Spar-Reduce-Scatter runs inside each team
of P / G consecutive ranks over P / G blocks; the ranks at the same position of every team then
gather their owned blocks, sum them and keep the top kb again (what they drop stays with the
ranks that held it), and each team gathers its blocks: at most k + P / G entries, in fewer messages (G - 1 + P / G - 1
instead of P - 1 after the reduce-scatter) for a little more volume.

Global residual collection: a rank's new residual is its own input everywhere except at the
result's indices, where it is what the rank held there and did not pass on. So
``total + sum_r residual_r == sum_r x_r`` exactly (a dropped partial sum stays with the rank that
dropped it, and an entry outside the result stays with every rank that put it in).
"""

from __future__ import annotations

from sparcml_jax.comm import S, Transport
from sparcml_jax.comm.topology import selection_budgets, spar_reduce_scatter_rounds


def spardl(t: Transport[S], x: S, *, k: int, teams: int = 1) -> tuple[S, S]:
    width = t.nprocs // teams  # ranks per team
    budgets = selection_budgets(k, t.size, width)
    blocks = t.split(x, parts=width)
    for distance, count in spar_reduce_scatter_rounds(width):  # Spar-Reduce-Scatter, in each team
        blocks = t.pass_blocks(blocks, distance=distance, count=count, budgets=budgets)
    owned, blocks = t.select_owned(blocks, budgets)
    if teams > 1:  # Spar-All-Gather: the owners of a block in every team sum theirs and re-select
        owned = t.reselect_across_teams(owned, budgets)
    total = t.allgather(owned, width=width)  # then every team gathers its blocks
    return total, t.residual(x, t.concat(blocks), total)
