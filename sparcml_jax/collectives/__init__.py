"""Sparse collectives: allreduce and allgather of sparse streams across MPI ranks (SparCML §5).

Every function works inside ``jax.jit`` and outside it. Static choices (sizes, capacities,
algorithm, transport) are checked collectively once per compiled signature, and every rank
validates its stream before anything is sent, so a bad input raises on every rank instead of
leaving peers blocked.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

from sparcml_jax.collectives._agree import cost_model_for, reject_everywhere, reset_after_error, signature
from sparcml_jax.collectives._plan import ALGORITHMS, AllreduceStats, Plan, Progress, check_quantize_options
from sparcml_jax.collectives.cost_model import CostModel
from sparcml_jax.collectives.dense import dense_allreduce, dense_as_stream
from sparcml_jax.collectives.dsar_split_allgather import dsar_split_allgather
from sparcml_jax.collectives.ssar_recursive_doubling import ssar_recursive_doubling
from sparcml_jax.collectives.ssar_split_allgather import ssar_split_allgather
from sparcml_jax.comm import get_transport, native, resolve_comm
from sparcml_jax.comm.topology import grown_capacity
from sparcml_jax.kernels._common import check_stream
from sparcml_jax.kernels.merge import merge_all
from sparcml_jax.stream import SparseStream, can_switch_to_dense, dense_threshold, resize

__all__ = ["ALGORITHMS", "AllreduceStats", "CostModel", "dense_allreduce", "reset_after_error", "sparse_allgather",
           "sparse_allreduce"]


def _algorithm_fn(name: str) -> Callable:
    return {
        "dense": dense_as_stream,
        "ssar_recursive_doubling": ssar_recursive_doubling,
        "ssar_split_allgather": ssar_split_allgather,
        "dsar_split_allgather": dsar_split_allgather,
    }[name]


def _run(name: str, s: SparseStream, plan: Plan, key) -> tuple[SparseStream, Progress]:
    if name == "dsar_split_allgather":
        return dsar_split_allgather(s, plan, key)
    return _algorithm_fn(name)(s, plan)


def sparse_allreduce(
    stream: SparseStream,
    *,
    comm: MPI.Comm | None = None,
    algorithm: str = "auto",
    transport: str = "native",
    delta: float = 1.0,
    quantize_bits: int | None = None,
    key: jax.Array | None = None,
    bucket_size: int = 1024,
    quantize_scale: str = "max",
    cost_model: CostModel | None = None,
    return_stats: bool = False,
):
    """Sum of every rank's stream; identical on every rank, dense where SparCML's rule says so.

    Args:
      stream: this rank's :class:`SparseStream`; every rank passes the same ``size`` and capacity.
      comm: mpi4py communicator; ``None`` is mpi4jax's default (a clone of COMM_WORLD).
      algorithm: ``"auto"`` (alpha-beta cost model, §5.3), ``"ssar_recursive_doubling"``,
        ``"ssar_split_allgather"``, ``"dsar_split_allgather"`` or ``"dense"``.
      transport: ``"native"`` (our MPI ops: only valid entries travel) or ``"mpi4jax"``
        (whole static buffers).
      delta: dense switch threshold: dense once ``8 nnz >= delta * 4 size``.
      quantize_bits: QSGD bits (2, 4, 8) for DSAR's dense allgather phase (§6); needs ``key``.
      key: PRNG key for QSGD; pass a fresh one every step.
      bucket_size, quantize_scale: QSGD bucket length and scale kind (``"max"`` or ``"l2"``).
      cost_model: alpha and beta for ``"auto"``; measured once per communicator if ``None``.
      return_stats: also return :class:`AllreduceStats`.

    Example (under ``mpirun -n P``; one process returns its input):
      >>> import jax.numpy as jnp
      >>> from mpi4py import MPI
      >>> from sparcml_jax import SparseStream, sparse_allreduce
      >>> x = jnp.zeros(8).at[MPI.COMM_WORLD.rank % 8].set(1.0)
      >>> total = sparse_allreduce(SparseStream.from_dense(x, capacity=1))
      >>> float(total.to_dense().sum()) == MPI.COMM_WORLD.size
      True
    """
    comm = resolve_comm(comm)
    measured = cost_model_for(comm)  # every rank's first collective on comm calibrates, whichever it is
    model = measured if cost_model is None else cost_model
    try:
        check_stream(stream, "stream")
        t = get_transport(transport)
        if algorithm != "auto" and algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be 'auto' or one of {ALGORITHMS}, got {algorithm!r}")
        if quantize_bits is not None:
            check_quantize_options(algorithm, quantize_bits, key)
    except (TypeError, ValueError) as e:
        reject_everywhere(comm, e)
    plan = Plan(comm, t, float(delta), quantize_bits, int(bucket_size), quantize_scale)
    fn = _compiled(plan, algorithm, model if algorithm == "auto" else None)
    key = jnp.zeros((2,), jnp.uint32) if key is None else key
    result, stats = _call_and_recover(fn, stream, key)
    return (result, stats) if return_stats else result


def _call_and_recover(fn, *args):
    """Runs a compiled collective; called eagerly, it also waits, so that an error surfaces here
    (on every rank together) and JAX's ordered-effect token is reset before it propagates."""
    try:
        out = fn(*args)
        if not any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(args)):
            jax.block_until_ready(out)
        return out
    except Exception:
        reset_after_error()
        raise


@functools.lru_cache(maxsize=256)
def _compiled(plan: Plan, algorithm: str, cost_model: CostModel | None):
    @jax.jit
    def run(stream: SparseStream, key):
        # Agrees on the signature, validates every rank's stream (all raise together) and on the largest nnz.
        summary = native.summary(stream, comm=plan.comm, signature=_signature(plan, algorithm, stream, cost_model))
        name = algorithm if algorithm != "auto" else _static_choice(plan, stream, cost_model)
        if name is not None:
            result, progress = _run(name, stream, plan, key)
            code = jnp.int32(ALGORITHMS.index(name))
        else:
            result, progress, code = _dynamic_choice(plan, stream, cost_model, key, max_nnz=summary[0])
        if isinstance(progress.status, jax.core.Tracer):  # a constant status (the dense path) cannot fail
            native.check(progress.status, comm=plan.comm)
        return result, AllreduceStats(code, progress.bytes_sent, result.nnz, progress.dense_round)

    return run


def _signature(plan: Plan, algorithm: str, s: SparseStream, model: CostModel | None) -> dict[str, int]:
    return signature(
        "allreduce", size=s.size, capacity=s.capacity, algorithm=(*ALGORITHMS, "auto").index(algorithm),
        transport=plan.transport.NAME, delta=plan.delta, quantize_bits=plan.quantize_bits,
        bucket_size=plan.bucket_size, quantize_scale=plan.quantize_scale,
        alpha=None if model is None else float(model.alpha), beta=None if model is None else float(model.beta),
    )


def _candidates(plan: Plan) -> tuple[str, ...]:
    """In order of preference on equal predicted cost (P = 1 costs nothing: no rounds at all)."""
    return ("ssar_recursive_doubling", "ssar_split_allgather", "dsar_split_allgather", "dense")


def _predict(cost_model: CostModel, plan: Plan, s: SparseStream, name: str, nnz, xp):
    return cost_model.predict(name, size=s.size, nnz=nnz, nprocs=plan.nprocs, transport=plan.transport.NAME,
                              capacity=s.capacity, quantize_bits=plan.quantize_bits if name.startswith("dsar") else None,
                              delta=plan.delta, xp=xp)


def _price(cost_model: CostModel, plan: Plan, s: SparseStream, name: str, nnz, xp):
    """The predicted time, or infinity for SSAR once the expected sum is dense, which the model
    cannot price: SparCML hands a sum that fills in to DSAR (the uniform union bound of its
    appendix B reaches the dense switch); SSAR would carry a dense vector as streams through
    every round, measured at 3-17x the prediction (2^22 values, 50 %, P = 2, 4).

    The mpi4jax transport moves whole buffers, so there the fill-in is that of the capacities
    (recursive doubling on streams of capacity N at 10 %, P = 4: 168 ms against 21 ms dense).
    """
    cost = _predict(cost_model, plan, s, name, nnz, xp)
    if plan.nprocs == 1:
        return cost
    if not name.startswith("ssar"):
        return cost
    n = max(s.size, 1)
    moved = s.capacity if plan.transport.NAME == "mpi4jax" else nnz
    union = n * (1.0 - (1.0 - xp.minimum(moved, n) / n) ** plan.nprocs)
    return xp.where(union >= dense_threshold(s.size, plan.delta), xp.inf, cost)


def _static_choice(plan: Plan, s: SparseStream, cost_model: CostModel) -> str | None:
    """The best algorithm priced at nnz = capacity, or None to choose at run time.

    A capacity too small for the dense form was sized for the data (top-k streams fill it), so
    its price is the price. A capacity that allows the dense form says little about the actual
    count: a sparse winner at that bound stays the winner for fewer nonzeros, anything else is
    decided at run time on the global nnz. The mpi4jax transport's prices depend on the
    capacities alone (it moves whole buffers), so its choice is always static.
    """
    costs = {name: float(_price(cost_model, plan, s, name, s.capacity, np)) for name in _candidates(plan)}
    best = min(costs, key=costs.get)
    if (plan.transport.NAME == "mpi4jax" or not can_switch_to_dense(s.capacity, s.size, plan.delta)
            or best.startswith("ssar")):
        return best
    return None


def _dynamic_choice(plan: Plan, s: SparseStream, cost_model: CostModel, key, max_nnz):
    """Chooses on the largest actual nnz over ranks (identical everywhere) and switches at run time."""
    max_nnz = max_nnz.astype(jnp.float32)
    costs = jnp.stack([_price(cost_model, plan, s, name, max_nnz, jnp) for name in ALGORITHMS])
    choice = jnp.argmin(costs).astype(jnp.int32)
    capacity = s.size

    def branch(name):
        def go(stream, key):
            result, progress = _run(name, stream, plan, key)
            return resize(result, capacity), progress

        return go

    result, progress = jax.lax.switch(choice, [branch(name) for name in ALGORITHMS], s, key)
    return result, progress, choice


def sparse_allgather(stream: SparseStream, *, comm: MPI.Comm | None = None, transport: str = "native",
                     delta: float = 1.0, return_stats: bool = False):
    """Union of every rank's stream (indices should be disjoint across ranks; overlaps are summed).

    This is also the naive "allgather, then sum" allreduce of DGC and GRACE.

    Example (under ``mpirun -n P``):
      >>> import jax.numpy as jnp
      >>> from mpi4py import MPI
      >>> from sparcml_jax import SparseStream, sparse_allgather
      >>> rank, size = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size
      >>> mine = SparseStream.from_dense(jnp.zeros(2 * size).at[2 * rank].set(rank + 1.0), capacity=1)
      >>> sparse_allgather(mine).to_dense()[::2].tolist() == [r + 1.0 for r in range(size)]
      True
    """
    comm = resolve_comm(comm)
    cost_model_for(comm)  # every rank's first collective on comm calibrates, whichever it is
    try:
        check_stream(stream, "stream")
        plan = Plan(comm, get_transport(transport), float(delta))
    except (TypeError, ValueError) as e:
        reject_everywhere(comm, e)
    result, stats = _call_and_recover(_compiled_allgather(plan), stream)
    return (result, stats) if return_stats else result


@functools.lru_cache(maxsize=64)
def _compiled_allgather(plan: Plan):
    @jax.jit
    def run(s: SparseStream):
        native.summary(s, comm=plan.comm, signature=signature(
            "allgather", size=s.size, capacity=s.capacity, transport=plan.transport.NAME, delta=plan.delta))
        (idx, val, nnz), status, sent = plan.transport.gather_streams(s, status=jnp.int32(0), comm=plan.comm)
        streams = [SparseStream(idx[r], val[r], nnz[r], s.size) for r in range(plan.nprocs)]
        result = resize(merge_all(streams, delta=plan.delta), grown_capacity(s.capacity, s.size, plan.nprocs, plan.delta))
        native.check(status, comm=plan.comm)
        return result, AllreduceStats(jnp.int32(-1), sent, result.nnz, jnp.int32(-1))

    return run
