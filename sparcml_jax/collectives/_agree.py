"""Collective trace-time checks: ranks that disagree on a static choice would deadlock later.

Runs once per compiled signature, on a duplicate of the communicator so it can never match a
message of an MPI call that XLA is still executing on the original one.
"""

from __future__ import annotations

from typing import Any

from mpi4py import MPI

# Keyed by the Fortran handle: mpi4py communicators are neither hashable by handle nor weak-referenceable.
_side_comms: dict[int, MPI.Comm] = {}
_cost_models: dict[int, Any] = {}


def side_comm(comm: MPI.Comm) -> MPI.Comm:
    key = comm.py2f()
    if key not in _side_comms:
        _side_comms[key] = comm.Dup()
    return _side_comms[key]


def agree(comm: MPI.Comm, what: str, signature: dict[str, Any], local_error: str | None = None) -> None:
    """Raises the same ValueError on every rank if any rank has an error or a different signature."""
    everyone = side_comm(comm).allgather((signature, local_error))
    for rank, (_, error) in enumerate(everyone):
        if error is not None:
            raise ValueError(f"{what}: invalid input on rank {rank}: {error}")
    for field in signature:
        values = [sig[field] for sig, _ in everyone]
        if any(v != values[0] for v in values):
            listing = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
            raise ValueError(f"{what}: ranks disagree on {field} ({listing}); every rank must pass the same {field}")


def cost_model_for(comm: MPI.Comm):
    """The calibrated cost model of ``comm``, measured once (collectively) and cached."""
    from sparcml_jax.collectives.cost_model import CostModel

    key = comm.py2f()
    if key not in _cost_models:
        _cost_models[key] = CostModel.calibrate(side_comm(comm))
    return _cost_models[key]
