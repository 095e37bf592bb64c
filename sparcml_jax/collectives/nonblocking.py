"""Non-blocking sparse allreduce (SparCML §7): start the reduction, compute, then wait.

A progress engine in C (ffi/bindings/mpi_calls.cc) runs each reduction's program, the one a
blocking call of the same algorithm runs, on a background thread, so the caller's computation
proceeds meanwhile. Several reductions may be in flight; the engine runs them in the order they
were started.

Why it cannot deadlock, and why nothing interleaves unsafely:

* ``start`` and ``wait`` are ordered-effect ops on mpi4jax's token chain, like every other MPI
  call of the program, so each rank starts its reductions in program order, and ``wait``
  follows its ``start`` through the handle's data dependency as well.
* The engine communicates on its own duplicate of each communicator, created by the first
  native call on that communicator (a collective call, ordered like the rest). Its messages can
  only match its own receives, and with MPI_THREAD_MULTIPLE its calls may run beside the main
  thread's (mpi4jax's and ours) at any time.
* The engine never waits for the main thread. A rank blocked in ``wait(j)`` only needs its peers
  to have *started* reductions up to ``j``, which they did before any op that follows in program
  order, so the blocked rank's peers cannot be waiting on it in turn. (With several communicators,
  this needs the usual MPI rule: ranks issue the starts in a consistent order.)
* Every message of a reduction carries its signature hash and error flags, so a mismatch or a
  bad input fails the reduction on every rank, and ``wait`` raises everywhere.
* At interpreter exit the engine finishes the reductions still in flight (all ranks run them);
  if a peer never started its part, the job aborts after a timeout instead of hanging.
"""

from __future__ import annotations

import dataclasses

import jax
from mpi4py import MPI

from sparcml_jax.collectives import auto, native_program
from sparcml_jax.collectives._plan import AllreduceStats
from sparcml_jax.collectives.cost_model import CostModel
from sparcml_jax.collectives.validate import (agree_on_the_engine, allreduce_signature, check_allreduce, reject_everywhere,
                                             reset_after_error)
from sparcml_jax.comm import native, resolve_comm
from sparcml_jax.kernels.qsgd import key_words
from sparcml_jax.stream import SparseStream


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
    index_capacity: int = dataclasses.field(default=-1, metadata=dict(static=True))  # -1: capacity


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
    try:
        if transport != "native":
            raise ValueError(f"the non-blocking engine speaks the native transport only, got transport={transport!r}; "
                             "use sparse_allreduce for the mpi4jax transport")
        plan = check_allreduce(comm, stream, algorithm=algorithm, transport=transport, delta=delta,
                               quantize_bits=quantize_bits, key=key, bucket_size=bucket_size,
                               quantize_scale=quantize_scale)
    except (TypeError, ValueError) as e:
        reject_everywhere(comm, e, engine=True)
    model = None
    if algorithm == "auto" and plan.nprocs > 1:
        if auto.calibrates(comm, cost_model):
            agree_on_the_engine(comm, "calibrate")  # where a peer's rejection (which need not be "auto") meets it
        model = auto.cost_model_for(comm, cost_model)
    dense = stream.dense_by_construction
    program = native_program(plan, algorithm, model, stream.size, stream.capacity, dense)
    words = key_words(jax.random.fold_in(key, plan.rank)) if plan.quantize else None  # as the blocking call keys it
    job = native.start(program, stream, comm=comm, signature=allreduce_signature(plan, algorithm, stream.size,
                                                                                 stream.capacity, model, dense),
                       delta=plan.delta, key_words=words)
    return AllreduceHandle(job, stream.size, program.capacity, program.index_capacity)


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
        index_capacity = handle.capacity if handle.index_capacity < 0 else handle.index_capacity
        result, algorithm, sent, dense_round = native.wait(handle.job, size=handle.size, capacity=handle.capacity,
                                                           index_capacity=index_capacity,
                                                           after=() if after is None else after)
        if not traced:
            jax.block_until_ready(result)
    except Exception:
        if not traced:
            reset_after_error()
        raise
    stats = AllreduceStats(algorithm, sent, result.nnz, dense_round)
    return (result, stats) if return_stats else result


__all__ = ["OVERLAP_COMPILER_OPTIONS", "AllreduceHandle", "sparse_allreduce_start", "sparse_allreduce_wait"]
