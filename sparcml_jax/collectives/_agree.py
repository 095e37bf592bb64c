"""Keeping ranks in step: the static signature every rank must share, rejection of bad
arguments on every rank, the cost model's calibration, and recovery after an error.

Ranks compare signatures inside the first MPI call of every collective (``native.summary``),
never at trace time: a rank whose program is cached does not trace, so a trace-time collective
would leave it and its peers in different calls.
"""

from __future__ import annotations

import struct
from typing import Any

import jax
import jax.numpy as jnp
from mpi4py import MPI

ARGUMENT_ERROR = "argument error"
SIGNATURE_FIELDS = 16  # fixed: every rank's summary must gather the same number of values
_cost_models: dict[int, Any] = {}


def signature(collective: str | None, **fields: Any) -> dict[str, int]:
    """The static choices of one call as named int64 values (the first field flags a rejected call)."""
    out = {ARGUMENT_ERROR: 0 if collective else 1,
           "collective": {"allreduce": 1, "allgather": 2, None: -1}[collective]}
    for name, value in fields.items():
        if isinstance(value, float):
            value = struct.unpack("<q", struct.pack("<d", value))[0]
        elif isinstance(value, str):
            value = int.from_bytes(value.encode()[:7].ljust(7, b"\0"), "little")
        out[name] = -1 if value is None else int(value)
    if len(out) > SIGNATURE_FIELDS:
        raise ValueError(f"a signature holds at most {SIGNATURE_FIELDS} fields, got {len(out)}")
    out.update({f"unused {i}": 0 for i in range(len(out), SIGNATURE_FIELDS)})
    return out


def reject_everywhere(comm: MPI.Comm, error: BaseException) -> None:
    """Makes this rank's peers raise too, then re-raises ``error`` here.

    The peers are in (or about to enter) the summary step of the same collective; this rank joins
    it with the argument-error flag set, so their signature check fails instead of blocking.
    """
    from sparcml_jax.comm import native
    from sparcml_jax.stream import SparseStream

    flagged = signature(None)
    empty = SparseStream(jnp.zeros((0,), jnp.int32), jnp.zeros((0,), jnp.float32), jnp.int32(0), 0)
    try:
        jax.jit(lambda s: native.summary(s, comm=comm, signature=flagged)).lower(empty).compile()(empty)
        jax.effects_barrier()
    except Exception:  # noqa: BLE001 - the mismatch error is expected; ours is the one to raise
        reset_after_error()
    raise error


def cost_model_for(comm: MPI.Comm):
    """The calibrated cost model of ``comm``: measured on the first collective of every rank on
    that communicator (whatever its algorithm, so that all ranks take part), then cached."""
    from sparcml_jax.collectives.cost_model import CostModel

    key = comm.py2f()
    if key not in _cost_models:
        _cost_models[key] = CostModel.calibrate(comm.Dup())
    return _cost_models[key]


def reset_after_error() -> None:
    """Clears JAX's ordered-effect token after a collective raised.

    JAX threads one runtime token through every program with an ordered effect (all MPI calls,
    ours and mpi4jax's). When a program fails while XLA runs it asynchronously, the token keeps
    the error and every later MPI program on that rank re-raises it without communicating. All
    ranks raise together, so all call this (after catching the error) and continue in step.
    """
    from jax._src import dispatch

    try:
        jax.effects_barrier()
    except Exception:  # noqa: BLE001 - the error being recovered from
        pass
    dispatch.runtime_tokens.clear()
