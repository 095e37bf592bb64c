"""Transports: how the algorithms move streams between ranks.

Both expose the same operations (``exchange``, ``reduce_scatter``, ``allgather``,
``allgather_dense``) and put every MPI call on mpi4jax's ordered effect.
"""

from __future__ import annotations

from types import ModuleType

from mpi4py import MPI

from sparcml_jax.comm import mpi4jax_transport, native

TRANSPORTS: dict[str, ModuleType] = {"native": native, "mpi4jax": mpi4jax_transport}


def get_transport(name: str) -> ModuleType:
    if name not in TRANSPORTS:
        raise ValueError(f"transport must be one of {sorted(TRANSPORTS)}, got {name!r}")
    return TRANSPORTS[name]


def resolve_comm(comm: MPI.Comm | None) -> MPI.Comm:
    """``comm=None`` means mpi4jax's default communicator (a clone of COMM_WORLD), as in mpi4jax."""
    if comm is None:
        from mpi4jax._src.utils import get_default_comm

        return get_default_comm()
    if not isinstance(comm, MPI.Intracomm):
        raise TypeError(f"comm must be an mpi4py intracommunicator (e.g. MPI.COMM_WORLD), got {type(comm).__name__}")
    return comm
