"""Non-blocking sparse allreduce (SparCML §7): start the reduction, compute, then wait.

A progress engine in C (ffi/bindings/mpi_engine.cc) runs each reduction's whole schedule, the
sends, receives and merges of the chosen algorithm, on a background thread, so the caller's
computation proceeds meanwhile. Several reductions may be in flight; the engine runs them in
the order they were started.

Why it cannot deadlock, and why nothing interleaves unsafely:

* ``start`` and ``wait`` are ordered-effect ops on mpi4jax's token chain, like every other MPI
  call of the program, so each rank starts its reductions in program order, and ``wait``
  follows its ``start`` through the handle's data dependency as well.
* The engine communicates on its own duplicate of each communicator, created by the first
  ``start`` on that communicator (a collective call, ordered like the rest). Its messages can
  only match its own receives, and with MPI_THREAD_MULTIPLE its calls may run beside the main
  thread's (mpi4jax's and ours) at any time.
* The engine never waits for the main thread. A rank blocked in ``wait(j)`` only needs its peers
  to have *started* reductions up to ``j``, which they did before any op that follows in program
  order, so the blocked rank's peers cannot be waiting on it in turn. (With several communicators,
  this needs the usual MPI rule: ranks issue the starts in a consistent order.)
* Every reduction begins with an agreement step in the engine (signature, stream validation,
  largest nnz), so a mismatch or a bad input fails the reduction on every rank, and ``wait``
  raises everywhere; it ends with an all-ranks status check, like the blocking collectives.
* At interpreter exit the engine finishes the reductions still in flight (all ranks run them);
  if a peer never started its part, the job aborts after a timeout instead of hanging.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from mpi4py import MPI

from sparcml_jax.collectives._agree import cost_model_for, reset_after_error, signature
from sparcml_jax.collectives._plan import ALGORITHMS, AllreduceStats, Plan, check_quantize_options
from sparcml_jax.collectives.cost_model import CostModel
from sparcml_jax.comm import engine, native, resolve_comm
from sparcml_jax.kernels._common import check_stream
from sparcml_jax.kernels.qsgd import _key_words
from sparcml_jax.stream import INDEX_DTYPE, VALUE_DTYPE, SparseStream


# Compile options for programs that overlap reductions with the backward pass (allreduce_gradients
# with buckets): XLA:CPU's default scheduler runs the whole backward pass before the first start;
# the memory-optimized one starts each bucket as soon as its gradients exist (checked on the
# schedule of examples/digits_mlp.py). Pass them to jax.jit(..., compiler_options=...).
OVERLAP_COMPILER_OPTIONS = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AllreduceHandle:
    """A reduction in flight: pass it to :func:`sparse_allreduce_wait` exactly once.

    Attributes:
      job: int32 scalar, the engine's id of the reduction (the data dependency of ``wait``).
      size: static dense length of the result.
      capacity: static capacity of the result stream.
    """

    job: jax.Array
    size: int = dataclasses.field(metadata=dict(static=True))
    capacity: int = dataclasses.field(metadata=dict(static=True))


def sparse_allreduce_start(
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
) -> AllreduceHandle:
    """Starts summing every rank's stream in the background and returns at once.

    The arguments mean what they mean for :func:`sparcml_jax.sparse_allreduce`; the result of
    :func:`sparse_allreduce_wait` is the same stream, bit for bit for the sparse algorithms.
    ``"auto"`` uses the same cost model, tabulated over the largest nnz, which the engine learns
    in its agreement step. QSGD on DSAR's dense phase takes the same ``key`` and gives the same
    codes as the blocking call. The engine speaks the native transport only.

    Example (under ``mpirun -n P``; one process returns its input):
      >>> import jax.numpy as jnp
      >>> from mpi4py import MPI
      >>> from sparcml_jax import SparseStream, sparse_allreduce_start, sparse_allreduce_wait
      >>> x = jnp.zeros(8).at[MPI.COMM_WORLD.rank % 8].set(1.0)
      >>> handle = sparse_allreduce_start(SparseStream.from_dense(x, capacity=1))
      >>> y = jnp.sin(x).sum()  # runs while the engine reduces
      >>> float(sparse_allreduce_wait(handle).to_dense().sum()) == MPI.COMM_WORLD.size
      True
    """
    comm = resolve_comm(comm)
    measured = cost_model_for(comm)  # every rank's first collective on comm calibrates, whichever it is
    model = measured if cost_model is None else cost_model
    try:
        check_stream(stream, "stream")
        if algorithm != "auto" and algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be 'auto' or one of {ALGORITHMS}, got {algorithm!r}")
        if transport != "native":
            raise ValueError(f"the non-blocking engine speaks the native transport only, got transport={transport!r}; "
                             "use sparse_allreduce for the mpi4jax transport")
        words = None
        if quantize_bits is not None:
            check_quantize_options(algorithm, quantize_bits, key)
            words = _key_words(jax.random.fold_in(key, comm.Get_rank()))  # as the blocking DSAR keys its ranks
        plan = Plan(comm, native, float(delta), quantize_bits, int(bucket_size), quantize_scale)
    except (TypeError, ValueError) as e:
        _reject_everywhere(comm, e)
    bounds, choices, capacity = _schedule(plan, stream.size, stream.capacity, algorithm, model)
    sig = signature("allreduce", size=stream.size, capacity=stream.capacity,
                    algorithm=(*ALGORITHMS, "auto").index(algorithm), delta=plan.delta,
                    quantize_bits=plan.quantize_bits, bucket_size=plan.bucket_size, quantize_scale=plan.quantize_scale,
                    alpha=float(model.alpha) if algorithm == "auto" else None,
                    beta=float(model.beta) if algorithm == "auto" else None)
    job = engine.start(stream, comm=comm, delta=plan.delta, signature=sig, choice_nnz=bounds, choice_algorithm=choices,
                       key_words=words, quantize_bits=plan.quantize_bits, bucket_size=plan.bucket_size,
                       quantize_scale=plan.quantize_scale)
    return AllreduceHandle(job, stream.size, capacity)


def sparse_allreduce_wait(handle: AllreduceHandle, *, after=None, return_stats: bool = False):
    """Blocks until the reduction of ``handle`` is done and returns its result (and stats).

    XLA orders ops by their data dependencies only, and on CPU it happily places an independent
    computation after the wait, where it hides nothing (``optimization_barrier`` does not help:
    XLA:CPU removes it before scheduling). Pass that computation's outputs (any pytree of arrays)
    as ``after``: they become operands of the wait, so XLA computes them first.

    An error of the reduction on any rank (a mismatch between ranks, an invalid stream) raises
    here, on every rank. Outside ``jit`` the error also resets JAX's ordered-effect token, as
    the blocking collectives do; inside your own ``jit``, call
    :func:`sparcml_jax.reset_after_error` after catching it.
    """
    traced = isinstance(handle.job, jax.core.Tracer)
    try:
        result, algorithm, sent, dense_round = engine.wait(handle.job, size=handle.size, capacity=handle.capacity,
                                                           after=() if after is None else after)
        if not traced:
            jax.block_until_ready(result)
    except Exception:
        if not traced:
            reset_after_error()
        raise
    stats = AllreduceStats(algorithm, sent, result.nnz, dense_round)
    return (result, stats) if return_stats else result


@functools.lru_cache(maxsize=256)
def _schedule(plan: Plan, size: int, capacity: int, algorithm: str, model: CostModel):
    """What a start needs beyond its stream, fixed per static signature (so an eager start every
    step does not re-price and re-trace): the choice table and the result's capacity."""
    shape = SparseStream(jax.ShapeDtypeStruct((capacity,), INDEX_DTYPE), jax.ShapeDtypeStruct((capacity,), VALUE_DTYPE),
                         jax.ShapeDtypeStruct((), INDEX_DTYPE), size)
    bounds, choices = _choice_table(plan, shape, algorithm, model)
    return bounds, choices, max(_result_capacity(ALGORITHMS[c], shape, plan) for c in choices)


def _choice_table(plan: Plan, s: SparseStream, algorithm: str, model: CostModel):
    """(nnz bounds, algorithm codes): the engine runs the first entry whose bound is at least the
    largest nnz over ranks. ``"auto"`` prices every candidate at powers of two up to the capacity."""
    if algorithm != "auto":
        return (s.capacity,), (ALGORITHMS.index(algorithm),)
    from sparcml_jax.collectives import _candidates, _price

    grid = sorted({0, s.capacity} | {1 << i for i in range(s.capacity.bit_length()) if 1 << i < s.capacity})
    bounds: list[int] = []
    choices: list[int] = []
    for g in grid:
        costs = {name: float(_price(model, plan, s, name, g, np)) for name in _candidates(plan)}
        best = ALGORITHMS.index(min(costs, key=costs.get))
        if choices and choices[-1] == best:
            bounds[-1] = g
        else:
            bounds.append(g)
            choices.append(best)
    return tuple(bounds), tuple(choices)


def _result_capacity(name: str, s: SparseStream, plan: Plan) -> int:
    """The capacity of the blocking algorithm's result (traced abstractly: nothing is sent)."""
    from sparcml_jax.collectives import _run

    shape = jax.eval_shape(lambda stream: _run(name, stream, plan, jax.random.PRNGKey(0))[0], s)
    return shape.capacity


def _reject_everywhere(comm: MPI.Comm, error: BaseException) -> None:
    """Submits a reduction flagged as rejected, so that the peers' reductions fail at their
    agreement step instead of waiting for this rank, then re-raises ``error`` here."""
    empty = SparseStream(jax.numpy.zeros((0,), np.int32), jax.numpy.zeros((0,), np.float32), jax.numpy.int32(0), 0)
    try:
        job = engine.start(empty, comm=comm, delta=1.0, signature=signature(None), choice_nnz=(0,),
                           choice_algorithm=(0,))
        engine.wait(job, size=0, capacity=1)[0].nnz.block_until_ready()
    except Exception:  # noqa: BLE001 - the mismatch error is expected; ours is the one to raise
        reset_after_error()
    raise error


__all__ = ["OVERLAP_COMPILER_OPTIONS", "AllreduceHandle", "sparse_allreduce_start", "sparse_allreduce_wait"]
