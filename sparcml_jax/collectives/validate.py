"""Keeping ranks in step: the arguments every collective checks, the static signature that ranks
compare, the one path that makes a rank's argument error raise on every rank, and recovery.

Ranks compare signatures inside the collective's own messages (``comm/native.py``), never at
trace time: a rank whose program is cached does not trace, so a trace-time collective would leave
it and its peers in different calls.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, NoReturn

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

from sparcml_jax.collectives._plan import ALGORITHMS, QUANTIZE_BITS, QUANTIZE_SCALES, Plan, Quantization
from sparcml_jax.comm import check_transport, native
from sparcml_jax.comm._compat import clear_runtime_tokens, outside_trace
from sparcml_jax.kernels._common import check_stream
from sparcml_jax.stream import SparseStream, dense_threshold


def check_allreduce(comm: MPI.Comm, stream: Any, *, algorithm: str, transport: str, delta: float,
                    quantize_bits: int | None, key: Any, bucket_size: int, quantize_scale: str,
                    quantize_feedback: bool = False, value_dtype: Any = None) -> Plan:
    """The plan of a valid call; raises TypeError or ValueError naming the argument otherwise."""
    check_transport(transport)
    quantize = check_allreduce_arguments(stream, algorithm=algorithm, delta=delta, quantize_bits=quantize_bits,
                                         key=key, bucket_size=bucket_size, quantize_scale=quantize_scale,
                                         quantize_feedback=quantize_feedback)
    return Plan(comm, transport, float(delta), quantize, wire_bits(value_dtype))


def wire_bits(value_dtype: Any) -> int:
    """Bits of the values on the wire for ``value_dtype`` (None: float32)."""
    if value_dtype is None:
        return 32
    try:
        dtype = jnp.dtype(value_dtype)
    except TypeError:
        dtype = None
    if dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"value_dtype must be jnp.float32 or jnp.bfloat16 (the values on the wire), got {value_dtype!r}")
    return 16 if dtype == jnp.bfloat16 else 32


def check_allreduce_arguments(stream: Any, *, algorithm: str, delta: float, quantize_bits: int | None, key: Any,
                              bucket_size: int, quantize_scale: str,
                              quantize_feedback: bool = False) -> Quantization | None:
    """The QSGD settings of a valid call (on any transport); raises naming the argument otherwise."""
    check_stream(stream, "stream")
    if algorithm != "auto" and algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be 'auto' or one of {ALGORITHMS}, got {algorithm!r}")
    dense_threshold(1, delta)  # raises for a delta that is not positive
    if not isinstance(quantize_feedback, bool):
        raise TypeError(f"quantize_feedback must be a bool, got {quantize_feedback!r}")
    if quantize_feedback and quantize_bits is None:
        raise ValueError("quantize_feedback returns the error of QSGD's split phase: it needs quantize_bits")
    quantize = None
    if quantize_bits is not None:
        if quantize_bits not in QUANTIZE_BITS:
            raise ValueError(f"quantize_bits must be one of {QUANTIZE_BITS} or None, got {quantize_bits!r}")
        if algorithm not in ("auto", "dsar_split_allgather"):
            raise ValueError(f"quantize_bits codes the dense phases of 'dsar_split_allgather' (or 'auto'), "
                             f"not {algorithm!r}")
        if key is None:
            raise ValueError("quantize_bits needs key=: a PRNG key, fresh every step, for QSGD's stochastic rounding")
        if isinstance(bucket_size, bool) or not isinstance(bucket_size, (int, np.integer)) or bucket_size < 1:
            raise ValueError(f"bucket_size must be a positive int (values per QSGD scale), got {bucket_size!r}")
        if quantize_scale not in QUANTIZE_SCALES:
            raise ValueError(f"quantize_scale must be one of {QUANTIZE_SCALES}, got {quantize_scale!r}")
        quantize = Quantization(int(quantize_bits), int(bucket_size), quantize_scale, quantize_feedback)
    return quantize


def model_digest(model: Any) -> int | None:
    """A cost model as one signature field: ranks must choose with the same numbers."""
    if model is None:
        return None
    packed = np.asarray(dataclasses.astuple(model), np.float64).tobytes()
    return int.from_bytes(hashlib.blake2b(packed, digest_size=8).digest(), "little", signed=True)


def allreduce_signature(plan: Plan, algorithm: str, size: int, capacity: int, model: Any,
                        dense: bool = False) -> native.Signature:
    """``dense``: the stream is dense by construction (``auto`` then chooses while tracing)."""
    q = plan.quantize
    return native.Signature.of(
        "allreduce", size=size, capacity=capacity, dense_input=int(dense),
        algorithm=(*ALGORITHMS, "auto").index(algorithm),
        transport=plan.transport, delta=plan.delta, quantize_bits=q and q.bits, bucket_size=q and q.bucket_size,
        quantize_scale=q and q.scale, cost_model=model_digest(model), value_bits=plan.value_bits)


def _empty() -> SparseStream:
    return SparseStream(jnp.zeros((0,), jnp.int32), jnp.zeros((0,), jnp.float32), jnp.int32(0), 0)


def reject_everywhere(comm: MPI.Comm, error: BaseException, *, engine: bool = False) -> NoReturn:
    """Makes this rank's peers raise too, then re-raises ``error`` here.

    The peers are in (or about to enter) the same collective: on the calling thread, or on the
    progress engine for ``engine``. This rank joins it with a call flagged as rejected, whose
    signature differs from theirs, so their call fails instead of waiting for this rank.
    """
    rejected = native.Signature.of(None)

    def join() -> None:
        try:
            if engine:
                _agree_on_the_engine(comm, rejected, rejected=True)
            else:
                jax.block_until_ready(jax.jit(lambda s: native.agree(s, comm=comm, signature=rejected,
                                                                      rejected=True))(_empty()))
            jax.effects_barrier()
        except Exception:  # noqa: BLE001 - the peers' mismatch is expected; ours is the error to raise
            reset_after_error()

    outside_trace(join)  # a rank that fails while its step is traced must make the call, not stage it
    raise on_every_rank(error)


def agree_on_the_engine(comm: MPI.Comm, what: str) -> None:
    """Every rank of ``comm`` agrees, on the progress engine, that it does ``what`` next.

    A rank that rejects its arguments in a non-blocking call does so on the engine. Before its
    peers do anything collective on their calling thread instead (calibrate the cost model for
    ``auto``), they agree there first, so that the rejection fails them instead of leaving
    both sides waiting. Raises on every rank if a rank rejected its arguments.
    """

    def join() -> None:
        try:
            _agree_on_the_engine(comm, native.Signature.of(what))
        except Exception as e:
            reset_after_error()
            raise on_every_rank(e)

    outside_trace(join)


def _agree_on_the_engine(comm: MPI.Comm, signature: native.Signature, rejected: bool = False) -> None:
    program = native.Program((native.AGREE, 0, 0, 0, 0, 0, 0, 0), -1, 0, 0)
    job = native.start(program, _empty(), comm=comm, signature=signature, delta=1.0, rejected=rejected)
    jax.block_until_ready(native.wait(job, size=0, capacity=0)[0].nnz)


def on_every_rank(error: BaseException) -> BaseException:
    """``error``, marked as raised on every rank of its collective (:func:`raised_everywhere`)."""
    try:
        error.sparcml_on_every_rank = True
    except AttributeError:  # an exception type without attributes of its own: never rejected twice anyway
        pass
    return error


def raised_everywhere(error: BaseException) -> bool:
    """Whether ``error`` already reached every rank: a collective's own failure, or an argument
    error that :func:`reject_everywhere` passed on. A caller that rejects what its stage raised
    must not pass these on a second time: the peers have already left the collective."""
    return getattr(error, "sparcml_on_every_rank", False)


def reset_after_error() -> None:
    """Clears JAX's ordered-effect token after a collective raised.

    JAX threads one runtime token through every program with an ordered effect (all MPI calls,
    ours and mpi4jax's). When a program fails while XLA runs it asynchronously, the token keeps
    the error and every later MPI program on that rank re-raises it without communicating. All
    ranks raise together, so all call this (after catching the error) and continue in step.
    """
    try:
        jax.effects_barrier()
    except Exception:  # noqa: BLE001 - the error being recovered from
        pass
    clear_runtime_tokens()


def call_and_recover(fn, *args):
    """Runs a compiled collective; called eagerly, it also waits, so that an error surfaces here
    (on every rank together) and JAX's ordered-effect token is reset before it propagates."""
    try:
        out = fn(*args)
        if not any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(args)):
            jax.block_until_ready(out)
        return out
    except Exception as e:
        reset_after_error()
        raise on_every_rank(e)
