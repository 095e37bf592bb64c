"""Sparse collectives: allreduce and allgather of sparse streams across MPI ranks (SparCML §5).

Every algorithm is one definition (its own module) over the operations of
:class:`sparcml_jax.comm.Transport`; each transport interprets it. Every function works inside
``jax.jit`` and outside it. Ranks compare their static choices and validate their streams inside
the collective's own messages, so a bad input raises on every rank instead of leaving peers blocked.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Hashable

import jax
import jax.numpy as jnp
from mpi4py import MPI

from sparcml_jax.collectives import auto, on_axis
from sparcml_jax.collectives._plan import ALGORITHMS, ENGINE_ALGORITHMS, AllreduceStats, Plan, definition
from sparcml_jax.collectives.cost_model import CostModel
from sparcml_jax.collectives.dense import dense_allreduce
from sparcml_jax.collectives.validate import (allreduce_signature, call_and_recover, check_allreduce,
                                              check_allreduce_arguments, on_every_rank, reject_everywhere,
                                              reset_after_error, wire_bits)
from sparcml_jax.comm import check_transport, native, resolve_comm
from sparcml_jax.comm.mpi4jax_transport import Mpi4jaxTransport
from sparcml_jax.kernels._common import check_stream, check_vector
from sparcml_jax.kernels.partition import from_dense
from sparcml_jax.kernels.qsgd import key_words
from sparcml_jax.stream import SparseStream, dense_stream, dense_threshold, with_indices

# The vectors nonzeros_allreduce takes: float32, or bfloat16 (summed in float32).
VECTOR_DTYPES = (jnp.float32, jnp.bfloat16)

__all__ = ["ALGORITHMS", "AllreduceStats", "CostModel", "dense_allreduce", "nonzeros_allreduce", "reset_after_error",
           "sparse_allgather", "sparse_allreduce"]

def sparse_allreduce(
    stream: SparseStream,
    *,
    comm: MPI.Comm | None = None,
    axis_name: Hashable | None = None,
    algorithm: str = "auto",
    transport: str | None = None,
    delta: float = 1.0,
    quantize_bits: int | None = None,
    key: jax.Array | None = None,
    bucket_size: int = 1024,
    quantize_scale: str = "max",
    quantize_feedback: bool = False,
    value_dtype: Any = None,
    cost_model: CostModel | None = None,
    return_stats: bool = False,
):
    """Sum of every rank's stream; identical on every rank, dense where SparCML's rule says so.

    Args:
      stream: this rank's :class:`SparseStream`; every rank passes the same ``size`` and capacity.
      comm: mpi4py communicator; ``None`` is mpi4jax's default (a clone of COMM_WORLD).
      axis_name: instead of ``comm``: inside ``jax.shard_map`` (or ``jax.pmap``), sum over the
        devices of this mesh axis with XLA's own collectives (any platform; whole static
        buffers, like ``"mpi4jax"``). ``"auto"`` then needs ``cost_model`` or
        ``SPARCML_JAX_COST_MODEL``, unless the axis spans all devices: then the model is
        measured over them at the first trace (:meth:`CostModel.calibrate_on_axis`).
      algorithm: ``"auto"`` (alpha-beta cost model, §5.3), ``"ssar_recursive_doubling"``,
        ``"ssar_split_allgather"``, ``"dsar_split_allgather"``, ``"sparse_ring"`` or ``"dense"``.
      transport: over MPI ``"native"`` (our MPI engine: only valid entries travel; the default)
        or ``"mpi4jax"`` (whole static buffers; the dense allreduce and DSAR, whose result is
        dense, run on the native engine on both); over a mesh axis ``"xla"`` (the default).
      delta: dense switch threshold: dense once ``8 nnz >= delta * 4 size``.
      quantize_bits: QSGD bits (2, 4, 8) wherever the sum travels dense (§6): DSAR's split-phase
        segments that turned dense and its allgather phase carry b-bit codes plus one float32
        scale per ``bucket_size`` values (about b/32 of float32's bytes), summed in float32;
        sparse segments stay exact pairs. ``"auto"`` then takes neither the float32 dense
        allreduce nor the ring, and takes SSAR (exact pairs) only where the model expects the sum
        to stay sparse. Needs ``key``.
      key: PRNG key for QSGD; pass a fresh one every step.
      bucket_size, quantize_scale: QSGD bucket length and scale kind (``"max"`` or ``"l2"``).
      quantize_feedback: also return this rank's split-phase coding error, float32[size]: each
        segment it sent as codes minus what the segment's owner decoded, zeros elsewhere (and
        everywhere when the call chose an exact algorithm). Added to the next call's input it
        is error feedback (EF-SGD); the allgather phase's error is shared by every rank and left
        to QSGD's unbiasedness. Blocking calls only.
      value_dtype: the values on the wire: ``jnp.float32`` (``None``, the default) or
        ``jnp.bfloat16`` (half the bytes of a value; pairs keep int32 indices): rounded to
        nearest even by their sender, who goes on with them as its peers receive them, and
        summed in float32; the result holds bfloat16 values, the same on every rank. Every
        SparCML algorithm, on every transport (whole static buffers carry two bfloat16 values
        per int32 slot), blocking calls; the dense allreduce then runs as DSAR's two phases
        (neither MPI nor ``psum`` sums bfloat16 in float32).
      cost_model: the model ``"auto"`` chooses with; by default the file named by
        ``SPARCML_JAX_COST_MODEL``, else measured once per communicator (a named algorithm
        never measures it).
      return_stats: also return :class:`AllreduceStats` (last).

    Example (under ``mpirun -n P``; one process returns its input):
      >>> import jax.numpy as jnp
      >>> from mpi4py import MPI
      >>> from sparcml_jax import SparseStream, sparse_allreduce
      >>> x = jnp.zeros(8).at[MPI.COMM_WORLD.rank % 8].set(1.0)
      >>> total = sparse_allreduce(SparseStream.from_dense(x, capacity=1))
      >>> float(total.to_dense().sum()) == MPI.COMM_WORLD.size
      True

    Over a mesh axis (here of 1 device, every device summing its copy of ``x``):
      >>> import jax
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> @jax.jit
      ... @jax.shard_map(mesh=mesh, in_specs=jax.P(), out_specs=jax.P(), check_vma=False)
      ... def summed(x):
      ...     s = SparseStream.from_dense(x, capacity=2)
      ...     return sparse_allreduce(s, axis_name="data", algorithm="ssar_split_allgather").to_dense()
      >>> summed(jnp.array([0.0, 2.0, 0.0, 1.0])).tolist()
      [0.0, 2.0, 0.0, 1.0]
    """
    if axis_name is not None:
        quantize = check_allreduce_arguments(stream, algorithm=algorithm, delta=delta, quantize_bits=quantize_bits,
                                             key=key, bucket_size=bucket_size, quantize_scale=quantize_scale,
                                             quantize_feedback=quantize_feedback)
        plan = on_axis.axis_plan(axis_name, comm, transport, delta, quantize, wire_bits(value_dtype))
        model = on_axis.cost_model_on_axis(cost_model, plan.nprocs) if algorithm == "auto" and plan.nprocs > 1 else None
        return _returned(*on_axis.allreduce(plan, algorithm, model, stream, key), return_stats)
    comm = resolve_comm(comm)
    transport = "native" if transport is None else transport
    try:
        plan = check_allreduce(comm, stream, algorithm=algorithm, transport=transport, delta=delta,
                               quantize_bits=quantize_bits, key=key, bucket_size=bucket_size,
                               quantize_scale=quantize_scale, quantize_feedback=quantize_feedback,
                               value_dtype=value_dtype)
    except (TypeError, ValueError) as e:
        reject_everywhere(comm, e)
    model = auto.cost_model_for(comm, cost_model) if algorithm == "auto" and plan.nprocs > 1 else None
    fn = _compiled(_unordered_if_asked(plan, "sparse_allreduce"), algorithm, model)
    key = jnp.zeros((2,), jnp.uint32) if key is None else key
    return _returned(*call_and_recover(fn, stream, key), return_stats)


def _unordered_if_asked(plan: Plan, name: str) -> Plan:
    """``plan`` unordered inside :func:`native.unordered_calls` (the native transport only: the
    other's calls are mpi4jax's, on its ordered effect)."""
    if plan.transport != "native":
        return plan
    try:
        unordered = native.unordered_call(name)
    except ValueError as e:  # every rank traces the same step: no peer waits to be told
        raise on_every_rank(e) from None
    return dataclasses.replace(plan, ordered=False) if unordered else plan


def _returned(result, stats, error, return_stats: bool):
    """What a call returns: the result, the coding error with ``quantize_feedback``, the stats."""
    out = (result,) + (() if error is None else (error,)) + ((stats,) if return_stats else ())
    return out if len(out) > 1 else result


def nonzeros_allreduce(
    x: jax.Array,
    *,
    comm: MPI.Comm | None = None,
    axis_name: Hashable | None = None,
    algorithm: str = "auto",
    transport: str | None = None,
    delta: float = 1.0,
    quantize_bits: int | None = None,
    key: jax.Array | None = None,
    bucket_size: int = 1024,
    quantize_scale: str = "max",
    quantize_feedback: bool = False,
    value_dtype: Any = None,
    cost_model: CostModel | None = None,
    average: bool = False,
    return_stats: bool = False,
):
    """Sum (or with ``average`` the mean) of every rank's float32 or bfloat16 vector ``x``, sent
    as its nonzeros: SparCML for gradients that are sparse or dense only at run time.

    It is ``sparse_allreduce(from_dense(x, delta=delta), ...).to_dense()`` without forming the
    stream. On the native engine each rank counts the nonzeros of ``x`` (one pass), the ranks
    agree on the largest count, ``"auto"`` chooses on it, and ``x`` is compacted into pairs only
    when its count is below the dense threshold: a dense ``x`` goes to MPI_Allreduce from where it
    lies. The arguments are those of :func:`sparse_allreduce`; the stats' ``result_nnz`` counts
    the sum's entries as a stream (``x.size`` once it is dense).

    The result has ``x``'s dtype. A bfloat16 ``x`` (a bfloat16 model's gradient) needs no
    float32 copy on the native engine: the engine widens its values as it reads them, sums in
    float32, divides by P for ``average``, and rounds once, to nearest even, as it writes the
    result (with ``value_dtype=jnp.bfloat16`` the values also travel as bfloat16). The other
    transports sum a float32 copy of ``x``. Either way the result is the float32 one, rounded.

    Example (under ``mpirun -n P``; one process returns ``x``):
      >>> import jax.numpy as jnp
      >>> from mpi4py import MPI
      >>> from sparcml_jax import nonzeros_allreduce
      >>> x = jnp.zeros(8).at[MPI.COMM_WORLD.rank % 8].set(1.0)
      >>> float(nonzeros_allreduce(x).sum()) == MPI.COMM_WORLD.size
      True
    """
    if axis_name is not None:
        check_average(average)
        x = check_vector(x, "x", dtype=VECTOR_DTYPES)
        total, *rest = sparse_allreduce(
            from_dense(x.astype(jnp.float32), delta=delta), axis_name=axis_name, comm=comm, algorithm=algorithm,
            transport=transport, delta=delta, quantize_bits=quantize_bits, key=key, bucket_size=bucket_size,
            quantize_scale=quantize_scale, quantize_feedback=quantize_feedback, value_dtype=value_dtype,
            cost_model=cost_model, return_stats=True)
        total = total.to_dense() / jax.lax.axis_size(axis_name) if average else total.to_dense()
        return _returned(total.astype(x.dtype), rest[-1], rest[0] if quantize_feedback else None, return_stats)
    comm = resolve_comm(comm)
    transport = "native" if transport is None else transport
    try:
        check_average(average)
        x = check_vector(x, "x", dtype=VECTOR_DTYPES)
        shaped = dense_stream(jax.ShapeDtypeStruct(x.shape, jnp.float32))  # (checked, not computed)
        plan = check_allreduce(comm, shaped, algorithm=algorithm, transport=transport, delta=delta,
                               quantize_bits=quantize_bits, key=key, bucket_size=bucket_size,
                               quantize_scale=quantize_scale, quantize_feedback=quantize_feedback,
                               value_dtype=value_dtype)
    except (TypeError, ValueError) as e:
        reject_everywhere(comm, e)
    model = auto.cost_model_for(comm, cost_model) if algorithm == "auto" and plan.nprocs > 1 else None
    key = jnp.zeros((2,), jnp.uint32) if key is None else key
    return _returned(*call_and_recover(_compiled_on_nonzeros(_unordered_if_asked(plan, "nonzeros_allreduce"),
                                                             algorithm, model, average), x, key),
                     return_stats)


def check_average(average: Any) -> None:
    if not isinstance(average, bool):
        raise TypeError(f"average must be a bool (divide the sum by the number of ranks), got {average!r}")


@functools.lru_cache(maxsize=256)
def _compiled_on_nonzeros(plan: Plan, algorithm: str, model: CostModel | None, average: bool):
    divisor = plan.nprocs if average else 1

    @jax.jit
    def run(x, key):
        n = x.shape[0]
        name = algorithm
        if plan.transport == "mpi4jax" and algorithm == "auto":
            (_, name), = _choices(plan, model, n, n)
        if plan.transport != "native" and name not in ENGINE_ALGORITHMS:  # static buffers: the stream of capacity n
            total, stats, error = _compiled(plan, algorithm, model)(from_dense(x.astype(jnp.float32),
                                                                              delta=plan.delta), key)
            dense = total.to_dense() / divisor if average else total.to_dense()
            return dense.astype(x.dtype), stats, error
        # The signature of from_dense(x)'s stream: the ranks run the same program on either.
        signature = allreduce_signature(plan, algorithm, n, n, model)
        program = native_program(plan, name, model, n, n, nonzeros=True)
        total, stats, error = _run_natively(plan, program, x if x.dtype != jnp.float32 else dense_stream(x),
                                            signature, key, divisor)
        return total.values, stats, error

    return run


@functools.lru_cache(maxsize=256)
def native_program(plan: Plan, algorithm: str, model: CostModel | None, size: int, capacity: int,
                   dense: bool = False, nonzeros: bool = False) -> native.Program:
    """The program the native transport runs for one static signature: the algorithm named, or
    for ``"auto"`` the one the cost model picks (at run time on the global nnz when it must; a
    stream ``dense`` by construction has a static count). With ``nonzeros`` it runs on the
    nonzeros of a dense vector (:func:`nonzeros_allreduce`)."""
    record = functools.partial(native.record, rank=plan.rank, nprocs=plan.nprocs, delta=plan.delta, size=size,
                               capacity=capacity, value_bits=plan.value_bits)
    rows = [(capacity, algorithm)] if algorithm != "auto" else _choices(plan, model, size, capacity, dense)
    if len(rows) == 1:
        name = rows[0][1]
        program = record(definition(name), code=ALGORITHMS.index(name), **plan.options(name))
        # The dense allreduce sums the values whatever their count.
        return native.on_nonzeros(program) if nonzeros and name != "dense" else program
    return native.record_choice([(bound, ALGORITHMS.index(name), definition(name), plan.options(name))
                                 for bound, name in rows], rank=plan.rank, nprocs=plan.nprocs, delta=plan.delta,
                                size=size, capacity=capacity, nonzeros=nonzeros, value_bits=plan.value_bits)


def _choices(plan: Plan, model: CostModel | None, size: int, capacity: int,
             dense: bool = False) -> list[tuple[int, str]]:
    if model is None:  # one process: nothing to choose, every algorithm returns its input summed with nothing
        return [(capacity, "ssar_recursive_doubling")]
    return auto.choice_table(model, plan, size, capacity, dense)


@functools.lru_cache(maxsize=256)
def _compiled(plan: Plan, algorithm: str, model: CostModel | None):
    @jax.jit
    def run(stream: SparseStream, key):
        dense = stream.dense_by_construction
        signature = allreduce_signature(plan, algorithm, stream.size, stream.capacity, model, dense)
        name = algorithm
        if plan.transport == "mpi4jax" and algorithm == "auto":
            (_, name), = _choices(plan, model, stream.size, stream.capacity, dense)
        # The engine's dense allreduce is one MPI_Allreduce: from the caller's buffer for a dense
        # stream, else on the stream densified straight into the result, in place.
        if plan.transport == "native" or name in ENGINE_ALGORITHMS:
            program = native_program(plan, name, model, stream.size, stream.capacity, dense)
            return _run_natively(plan, program, stream, signature, key)
        # Static buffers cannot carry an abort: the ranks agree first.
        t = Mpi4jaxTransport(plan.comm, plan.delta, stream.size, native.agree(stream, comm=plan.comm,
                                                                              signature=signature), key,
                             plan.value_bits)
        result = t.as_result(definition(name)(t, with_indices(stream), **plan.options(name)))  # (nothing coded)
        stats = AllreduceStats(jnp.int32(ALGORITHMS.index(name)), t.sent, result.nnz, t.dense_round)
        return result, stats, _no_error(plan, stream.size)

    return run


def _run_natively(plan: Plan, program: native.Program, stream: SparseStream | jax.Array, signature, key,
                  divisor: int = 1):
    """(result, stats, this rank's coding error when the plan asks for it, else None); ``stream``
    may be a dense vector, and the result is divided by ``divisor`` (see :func:`native.run_with_residual`)."""
    words = key_words(jax.random.fold_in(key, plan.rank)) if plan.quantize else None
    result, code, sent, dense_round, error = native.run_with_residual(program, stream, comm=plan.comm,
                                                                      signature=signature, delta=plan.delta,
                                                                      key_words=words, divisor=divisor,
                                                                      ordered=plan.ordered)
    if program.residual < 0:  # an exact algorithm: nothing lost
        error = _no_error(plan, program.size)
    elif not (plan.quantize and plan.quantize.feedback):
        error = None
    return result, AllreduceStats(code, sent, result.nnz, dense_round), error


def _no_error(plan: Plan, size: int) -> jax.Array | None:
    return jnp.zeros((size,), jnp.float32) if plan.quantize and plan.quantize.feedback else None


def sparse_allgather(stream: SparseStream, *, comm: MPI.Comm | None = None, axis_name: Hashable | None = None,
                     transport: str | None = None, delta: float = 1.0, return_stats: bool = False):
    """Union of every rank's stream (indices should be disjoint across ranks; overlaps are summed).

    This is also the naive "allgather, then sum" allreduce of DGC and GRACE. ``comm``,
    ``axis_name`` and ``transport`` as in :func:`sparse_allreduce`.

    Example (under ``mpirun -n P``):
      >>> import jax.numpy as jnp
      >>> from mpi4py import MPI
      >>> from sparcml_jax import SparseStream, sparse_allgather
      >>> rank, size = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size
      >>> mine = SparseStream.from_dense(jnp.zeros(2 * size).at[2 * rank].set(rank + 1.0), capacity=1)
      >>> sparse_allgather(mine).to_dense()[::2].tolist() == [r + 1.0 for r in range(size)]
      True
    """
    if axis_name is not None:
        check_stream(stream, "stream")
        dense_threshold(1, delta)  # raises for a delta that is not positive
        result, stats = on_axis.allgather(on_axis.axis_plan(axis_name, comm, transport, delta), stream)
        return (result, stats) if return_stats else result
    comm = resolve_comm(comm)
    try:
        check_stream(stream, "stream")
        plan = Plan(comm, check_transport("native" if transport is None else transport), float(delta))
    except (TypeError, ValueError) as e:
        reject_everywhere(comm, e)
    result, stats = call_and_recover(_compiled_allgather(plan), stream)
    return (result, stats) if return_stats else result


@functools.lru_cache(maxsize=64)
def _compiled_allgather(plan: Plan):
    def gather(t, s):
        return t.gather(s)

    @jax.jit
    def run(s: SparseStream):
        signature = native.Signature.of("allgather", size=s.size, capacity=s.capacity, transport=plan.transport,
                                        delta=plan.delta)
        if plan.transport == "native":
            program = native.record(gather, rank=plan.rank, nprocs=plan.nprocs, delta=plan.delta, size=s.size,
                                    capacity=s.capacity, code=-1)
            result, _, sent, _ = native.run(program, s, comm=plan.comm, signature=signature, delta=plan.delta)
        else:
            t = Mpi4jaxTransport(plan.comm, plan.delta, s.size, native.agree(s, comm=plan.comm, signature=signature))
            result, sent = t.gather(with_indices(s)), t.sent
        return result, AllreduceStats(jnp.int32(-1), sent, result.nnz, jnp.int32(-1))

    return run
