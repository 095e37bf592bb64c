"""The global top-k allreduce: a result of about k entries whatever P is, the rest returned to
the ranks' residuals (SparDL, arXiv 2304.00737; gTop-k, Shi et al. 2019).

SparCML's sparse allreduce sums every rank's top k exactly, so its result grows towards P k and
turns dense as P grows (SparDL's "sparse gradient accumulation dilemma"). These algorithms
re-select inside the collective and keep the books exact: what they drop goes to a residual.
"""

from __future__ import annotations

import functools
from typing import Hashable, NamedTuple

import jax
import jax.numpy as jnp
import mpi4jax
import numpy as np
from mpi4py import MPI

from sparcml_jax.collectives import on_axis
from sparcml_jax.collectives._plan import GLOBAL_TOPK_ALGORITHMS, Plan, definition
from sparcml_jax.collectives.validate import call_and_recover, reject_everywhere
from sparcml_jax.comm import check_transport, native, resolve_comm
from sparcml_jax.comm.mpi4jax_transport import Mpi4jaxTransport
from sparcml_jax.comm.xla_transport import NAME as XLA
from sparcml_jax.comm.xla_transport import XlaTransport, agree
from sparcml_jax.kernels._common import check_vector, cond_varying
from sparcml_jax.kernels.partition import partition_bounds
from sparcml_jax.kernels.topk import topk
from sparcml_jax.stream import SparseStream, dense_stream, dense_threshold, resize, with_indices


class OktopkState(NamedTuple):
    """Ok-Topk's estimates, carried from step to step (keep them in the optimizer state).

    Attributes:
      step: int32 calls made so far; thresholds are re-evaluated exactly when ``step % tau == 0``
        and the regions re-balanced when ``step % tau_prime == 0``.
      local_threshold: float32 this rank's threshold for its own selection.
      global_threshold: float32 the owners' threshold on the reduced regions (the same on every rank).
      starts: int32[P - 1] first index of regions 1..P-1 (the same on every rank).
    """

    step: jax.Array
    local_threshold: jax.Array
    global_threshold: jax.Array
    starts: jax.Array


def init_oktopk_state(comm: MPI.Comm | None = None, *, nprocs: int | None = None) -> OktopkState:
    """The state of a first step: every estimate is computed afresh on it.

    Args:
      comm: the communicator of the calls; ``None`` is mpi4jax's default (a clone of COMM_WORLD).
      nprocs: instead, the number of devices of the mesh axis of the calls (``axis_name=``).

    Example:
      >>> from sparcml_jax import init_oktopk_state
      >>> int(init_oktopk_state().step), init_oktopk_state(nprocs=4).starts.shape
      (0, (3,))
    """
    if nprocs is None:
        nprocs = resolve_comm(comm).Get_size()
    elif comm is not None or isinstance(nprocs, bool) or not isinstance(nprocs, (int, np.integer)) or nprocs < 1:
        raise ValueError(f"init_oktopk_state takes comm or nprocs (a positive int), got comm={comm!r}, "
                         f"nprocs={nprocs!r}")
    return OktopkState(jnp.int32(0), jnp.float32(0), jnp.float32(0), jnp.zeros((nprocs - 1,), jnp.int32))


# Ok-Topk's public code: thresholds move by these factors when a step selected outside [0.8 k, 1.25 k].
_LOCAL_SCALE, _GLOBAL_RAISE, _GLOBAL_LOWER = 1.025, 1.025, 1.036


class GlobalTopkStats(NamedTuple):
    """What one global top-k allreduce did on this rank (a pytree of scalars).

    Attributes:
      algorithm: int32 index into ``GLOBAL_TOPK_ALGORITHMS``.
      bytes_sent: float32 bytes this rank sent (as :class:`AllreduceStats` counts them).
      result_nnz: int32 entries of the result (``size`` when dense).
      returned: float32 ``sum |residual|`` of this rank: the mass left for its next step.
    """

    algorithm: jax.Array
    bytes_sent: jax.Array
    result_nnz: jax.Array
    returned: jax.Array


def global_topk_allreduce(
    x: jax.Array,
    k: int,
    *,
    algorithm: str = "spardl",
    comm: MPI.Comm | None = None,
    axis_name: Hashable | None = None,
    transport: str | None = None,
    delta: float = 1.0,
    teams: int = 1,
    oktopk_state: OktopkState | None = None,
    tau: int = 128,
    tau_prime: int = 64,
    return_stats: bool = False,
):
    r"""About the ``k`` largest entries of the sum of every rank's ``x``, and this rank's residual.

    With :math:`x_r` this rank's accumulated gradient (gradient plus residual), the result
    ``total`` (a :class:`SparseStream`, identical on every rank) and each rank's dense
    ``residual`` keep exact books:

    .. math::  \mathrm{total} + \sum_r \mathrm{residual}_r = \sum_r x_r

    (bit for bit on integer-valued data), so error feedback loses nothing. ``k = size`` gives
    the dense sum and zero residuals.

    - ``"spardl"`` (SparDL §4): Spar-Reduce-Scatter (each rank sends P - 1 blocks of about k / P
      pairs, re-selected before each send), an allgather of the owned blocks, and global
      residual collection: a rank's residual is its own ``x`` except where the result is
      nonzero, where it is what the rank held there and did not pass on. At most k + P entries.
      With ``teams`` G > 1 (Spar-All-Gather): the reduce-scatter runs in teams of P / G ranks,
      the owners of a block in every team sum theirs and keep its top k / (P / G) again, and
      each team gathers its blocks; at most k + P / G entries, in log2(P / G) + G + P / G - 2
      messages per rank instead of log2 P + P - 1 (a little more volume: the teams' sums).
    - ``"gtopk"`` (gTop-k): a binomial tree of merges that keeps the top k of each, then a
      broadcast; every value dropped at a merge stays in the residual of the rank that dropped
      it (the published algorithm loses it at P >= 4). At most k entries.
    - ``"oktopk"`` (Ok-Topk, PPoPP'22 §3): a local threshold selection, a sparse reduce-scatter
      over regions balanced by the selected indices, a global threshold on the reduced regions
      and an allgather. Its estimates live in ``oktopk_state``: the thresholds are computed
      exactly (k-th largest magnitude) every ``tau`` steps and moved by Ok-Topk's factors in
      between; the regions are re-balanced every ``tau_prime`` steps from the selected indices
      of every rank (a small integer allreduce). At most k entries on a step that re-evaluates
      (every call without a state), at most P ceil(2k / P) <= 2k + P otherwise.

    Args:
      x: this rank's float32[size] accumulator; every rank passes the same size.
      k: static int in ``[0, size]``: the size of the global result.
      algorithm: one of ``GLOBAL_TOPK_ALGORITHMS``.
      comm: mpi4py communicator; ``None`` is mpi4jax's default (a clone of COMM_WORLD).
      axis_name: instead of ``comm``: inside ``jax.shard_map`` (or ``jax.pmap``), over the
        devices of this mesh axis, on XLA's collectives (see :func:`sparse_allreduce`).
      transport: over MPI ``"native"`` (only valid entries travel; the default) or
        ``"mpi4jax"`` (static buffers); over a mesh axis ``"xla"`` (the default).
      delta: SparCML's dense switch for the result (dense once ``8 nnz >= delta 4 size``).
      teams: SparDL's teams G (a static int that divides P); 1 is the plain allgather.
      oktopk_state: Ok-Topk's :class:`OktopkState` (from :func:`init_oktopk_state`, then from
        the previous call); with it the call also returns the next state.
      tau, tau_prime: Ok-Topk's intervals (static ints >= 1) of exact thresholds and of balanced
        regions (its public code's defaults).
      return_stats: also return :class:`GlobalTopkStats`.

    Returns:
      ``(total, residual)``, with ``oktopk_state`` ``(total, residual, next_state)``, and
      :class:`GlobalTopkStats` last with ``return_stats``.

    Example (under ``mpirun -n P``):
      >>> import jax.numpy as jnp
      >>> import numpy as np
      >>> from mpi4py import MPI
      >>> from sparcml_jax import global_topk_allreduce, init_oktopk_state
      >>> P = MPI.COMM_WORLD.size
      >>> total, residual = global_topk_allreduce(jnp.arange(8.0), 2, algorithm="gtopk")
      >>> total.indices.tolist(), total.values.tolist() == [6.0 * P, 7.0 * P]
      ([6, 7], True)
      >>> residuals = MPI.COMM_WORLD.allreduce(np.asarray(residual), op=MPI.SUM)
      >>> bool(np.all(total.to_dense() + residuals == P * np.arange(8.0)))
      True
      >>> state = init_oktopk_state()
      >>> total, residual, state = global_topk_allreduce(jnp.arange(8.0), 2, algorithm="oktopk", oktopk_state=state)
      >>> total.indices[: int(total.nnz)].tolist(), int(state.step)
      ([6, 7], 1)
    """
    if axis_name is not None:
        size, k = _check(x, k, algorithm, delta)
        plan = on_axis.axis_plan(axis_name, comm, transport, delta)
        check_options(algorithm, teams, tau, tau_prime)
        _check_oktopk(plan.nprocs, algorithm, oktopk_state)
        _check_teams(plan.nprocs, teams)
        call = lambda fn, *args: fn(*args)  # noqa: E731
    else:
        comm = resolve_comm(comm)
        transport = "native" if transport is None else transport
        try:
            size, k = _check(x, k, algorithm, delta)
            plan = Plan(comm, check_transport(transport), float(delta))
            check_options(algorithm, teams, tau, tau_prime)
            _check_oktopk(plan.nprocs, algorithm, oktopk_state)
            _check_teams(plan.nprocs, teams)
        except (TypeError, ValueError) as e:
            reject_everywhere(comm, e)
        call = call_and_recover
    if algorithm != "oktopk":
        total, residual, stats = call(_compiled(plan, algorithm, size, k, int(teams)), x)
        return (total, residual, stats) if return_stats else (total, residual)
    state = init_oktopk_state(nprocs=plan.nprocs) if oktopk_state is None else oktopk_state
    total, residual, state, stats = call(_compiled_oktopk(plan, size, k, int(tau), int(tau_prime)), x, state)
    out = (total, residual) + ((state,) if oktopk_state is not None else ())
    return out + (stats,) if return_stats else out


def _check(x, k, algorithm: str, delta: float) -> tuple[int, int]:
    if isinstance(x, SparseStream):
        raise TypeError("x must be this rank's dense float32 accumulator (gradient plus residual), got a "
                        "SparseStream; pass stream.to_dense()")
    x = check_vector(x, "x")
    if algorithm not in GLOBAL_TOPK_ALGORITHMS:
        raise ValueError(f"algorithm must be one of {GLOBAL_TOPK_ALGORITHMS}, got {algorithm!r}")
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
        raise TypeError(f"k must be a static Python int (the size of the result), got {type(k).__name__}; "
                        "under jax.jit mark it static")
    size = x.shape[0]
    if not 0 <= k <= size:
        raise ValueError(f"k={k} must lie in [0, len(x)={size}]; clip it, e.g. k=min(k, x.size)")
    dense_threshold(1, delta)  # raises for a delta that is not positive
    return size, int(k)


def check_options(algorithm: str, teams, tau, tau_prime) -> None:
    """Raises for a ``teams``, ``tau`` or ``tau_prime`` that no number of ranks accepts."""
    for name, value in (("tau", tau), ("tau_prime", tau_prime)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be a static int >= 1 (steps between Ok-Topk's re-evaluations), got {value!r}")
    if isinstance(teams, bool) or not isinstance(teams, (int, np.integer)) or teams < 1:
        raise ValueError(f"teams must be a static int >= 1 (SparDL's teams), got {teams!r}")
    if teams > 1 and algorithm != "spardl":
        raise ValueError(f"teams is SparDL's Spar-All-Gather; algorithm={algorithm!r} has none: drop teams or pass "
                         "algorithm='spardl'")


def _check_oktopk(nprocs: int, algorithm: str, state) -> None:
    if state is None:
        return
    if algorithm != "oktopk":
        raise ValueError(f"oktopk_state is Ok-Topk's; algorithm={algorithm!r} keeps no state: drop it or pass "
                         "algorithm='oktopk'")
    if not isinstance(state, OktopkState):
        raise TypeError(f"oktopk_state must be an OktopkState (from init_oktopk_state), got {type(state).__name__}")
    want = init_oktopk_state(nprocs=nprocs)
    for name, got, like in zip(OktopkState._fields, state, want):
        if jnp.shape(got) != like.shape or jnp.result_type(got) != like.dtype:
            raise ValueError(f"oktopk_state.{name} must be {like.dtype}{list(like.shape)} for {nprocs} ranks, "
                             f"got {jnp.result_type(got)}{list(jnp.shape(got))}; start from init_oktopk_state(comm) "
                             "(or init_oktopk_state(nprocs=...) for a mesh axis)")


def _check_teams(nprocs: int, teams: int) -> None:
    if nprocs % teams:
        raise ValueError(f"teams={teams} must divide the number of ranks ({nprocs}), e.g. teams=1")


@functools.lru_cache(maxsize=128)
def _compiled(plan: Plan, algorithm: str, size: int, k: int, teams: int):
    code = GLOBAL_TOPK_ALGORITHMS.index(algorithm)
    options = {"teams": teams} if teams > 1 else {}

    @jax.jit
    def run(x: jax.Array):
        signature = native.Signature.of("global_topk", size=size, k=k, algorithm=code, transport=plan.transport,
                                        delta=plan.delta, teams=teams)
        total, residual, sent = _run(plan, algorithm, size, k, signature, dense_stream(x), {}, **options)
        stats = GlobalTopkStats(jnp.int32(code), sent, total.nnz, jnp.sum(jnp.abs(residual)))
        return total, residual, stats

    return run


def _run(plan: Plan, algorithm: str, size: int, k: int, signature: native.Signature, stream: SparseStream,
         operands: dict, **options):
    """The definition on this rank's dense ``stream`` with its static ``options``: (total,
    residual, bytes sent). Ok-Topk's run-time ``operands`` (local_threshold, global_threshold,
    starts) are jax values."""
    if plan.transport == "native":
        program = _program(plan, algorithm, size, k, **options)
        words = None
        if operands:
            words = jnp.concatenate([jax.lax.bitcast_convert_type(jnp.stack([operands["local_threshold"],
                                                                             operands["global_threshold"]]), jnp.uint32),
                                     operands["starts"].astype(jnp.uint32)])
        return native.run_global_topk(program, stream, comm=plan.comm, signature=signature, delta=plan.delta,
                                      operands=words)
    if plan.transport == XLA:
        t = XlaTransport(plan.axis_name, plan.nprocs, plan.delta, size, agree(stream, plan.axis_name, "x"))
    else:
        agreed = native.agree(stream, comm=plan.comm, signature=signature)  # static buffers cannot carry an abort
        t = Mpi4jaxTransport(plan.comm, plan.delta, size, agreed)
    total, held = definition(algorithm)(t, with_indices(stream), k=k, **operands, **options)
    return total, held.values, t.sent


@functools.lru_cache(maxsize=128)
def _program(plan: Plan, algorithm: str, size: int, k: int, **options) -> native.Program:
    if "exact" in options:  # Ok-Topk's run-time operands, in the order _run packs them
        options.update(local_threshold=native.Operand(0), global_threshold=native.Operand(1),
                       starts=native.Operand(2))
    return native.record(definition(algorithm), rank=plan.rank, nprocs=plan.nprocs, delta=plan.delta, size=size,
                         capacity=size, code=GLOBAL_TOPK_ALGORITHMS.index(algorithm), k=k, **options)


@functools.lru_cache(maxsize=128)
def _compiled_oktopk(plan: Plan, size: int, k: int, tau: int, tau_prime: int):
    code, p = GLOBAL_TOPK_ALGORITHMS.index("oktopk"), plan.nprocs
    cond = functools.partial(cond_varying, axes=frozenset([plan.axis_name]) if plan.transport == XLA else frozenset())

    @jax.jit
    def run(x: jax.Array, state: OktopkState):
        if plan.transport == XLA:  # the step decides collectives: the same on every device
            state = state._replace(step=on_axis.same_everywhere(state.step, plan.axis_name, "oktopk_state.step"))
        exact = state.step % tau == 0
        local = cond(exact, lambda: _kth_magnitude(topk(x, k).values, k), lambda: state.local_threshold)
        balance = native.Signature.of("global_topk", size=size, k=k, algorithm=code, transport=plan.transport,
                                      delta=plan.delta, exact=None, balance=1)
        starts = cond(state.step % tau_prime == 0, lambda: _balanced_starts(x, local, plan, balance),
                      lambda: state.starts)
        operands = dict(local_threshold=local, global_threshold=state.global_threshold, starts=starts)

        def branch(reevaluates: bool, capacity: int | None = None):
            def go(x, operands):
                signature = native.Signature.of("global_topk", size=size, k=k, algorithm=code,
                                                transport=plan.transport, delta=plan.delta, exact=reevaluates,
                                                balance=0)
                total, residual, sent = _run(plan, "oktopk", size, k, signature, dense_stream(x), operands,
                                             exact=reevaluates)
                return (total if capacity is None else resize(total, capacity)), residual, sent
            return go

        # The two steps' results differ in capacity (k after a re-evaluation): both travel in the larger.
        capacity = max(jax.eval_shape(branch(e), x, operands)[0].capacity for e in (True, False))
        total, residual, sent = cond(exact, branch(True, capacity), branch(False, capacity), x, operands)
        selected = jnp.sum((x != 0) & (jnp.abs(x) >= local), dtype=jnp.int32)
        next_state = OktopkState(state.step + 1, _moved(local, selected, k, _LOCAL_SCALE, _LOCAL_SCALE),
                                 jnp.where(exact, _kth_magnitude(total.values, total.nnz),
                                           _moved(state.global_threshold, total.nnz, k, _GLOBAL_RAISE, _GLOBAL_LOWER)),
                                 starts)
        if p > 1:  # the balancing allreduce of 2 (P - 1) int32 on its steps
            sent = sent + jnp.where(state.step % tau_prime == 0, 2 * (p - 1) / p * 8 * (p - 1), 0.0).astype(sent.dtype)
        stats = GlobalTopkStats(jnp.int32(code), sent, total.nnz, jnp.sum(jnp.abs(residual)))
        return total, residual, next_state, stats

    return run


def _kth_magnitude(values: jax.Array, count) -> jax.Array:
    """The smallest magnitude among the first ``count`` of ``values`` (a top-k's): the k-th
    largest; 0 (every nonzero qualifies) for none."""
    valid = jnp.arange(values.shape[0]) < count
    least = jnp.min(jnp.where(valid, jnp.abs(values), jnp.inf), initial=jnp.inf)
    return jnp.where(jnp.any(valid), least, 0.0).astype(jnp.float32)


def _moved(threshold: jax.Array, selected: jax.Array, k: int, raise_by: float, lower_by: float) -> jax.Array:
    """Ok-Topk's correction: a threshold that selected fewer than 0.8 k entries goes down, one
    that selected more than 1.25 k goes up."""
    low, high = selected < 0.8 * k, selected > 1.25 * k
    return jnp.where(low, threshold / lower_by, jnp.where(high, threshold * raise_by, threshold)).astype(jnp.float32)


def _balanced_starts(x: jax.Array, threshold: jax.Array, plan: Plan, signature: native.Signature) -> jax.Array:
    """Ok-Topk's region boundaries: every rank samples the positions of its selected indices at
    ranks count i / P (i = 1..P-1) and the samples are averaged over ranks. The average is
    exact in int32: ranks add their quotients and remainders by P. Ranks agree first, so that a
    rank at another step (which skips this) fails every rank's call instead of hanging it."""
    p, n = plan.nprocs, x.shape[0]
    if p == 1:
        return jnp.zeros((0,), jnp.int32)
    chosen = (x != 0) & (jnp.abs(x) >= threshold)
    ranks = jnp.cumsum(chosen, dtype=jnp.int32)
    count = ranks[-1] if n else jnp.int32(0)
    i = jnp.arange(1, p, dtype=jnp.int32)
    sampled = jnp.searchsorted(ranks, (count // p) * i + 1, side="left").astype(jnp.int32)
    even = jnp.asarray(partition_bounds(n, p)[1:-1], jnp.int32)
    sample = jnp.where(count >= p, sampled, even)  # too few to sample: the even split
    parts = jnp.concatenate([sample // p, sample % p])
    if plan.transport == XLA:  # every device is at the same step (checked before)
        summed = jax.lax.psum(parts, plan.axis_name)
    else:
        agreed = native.agree(dense_stream(sample.astype(jnp.float32)), comm=plan.comm, signature=signature)
        parts = jnp.where(agreed < 0, 0, parts)  # (never: it orders them)
        summed = mpi4jax.allreduce(parts, op=MPI.SUM, comm=plan.comm)
    return summed[: p - 1] + summed[p - 1:] // p
