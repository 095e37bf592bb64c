"""The ranks a gradient stage sums over: an MPI communicator (``comm=``) or a mesh axis
(``axis_name=``, inside ``jax.shard_map``), with what the stages ask of either."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Hashable

import jax
from mpi4py import MPI

from sparcml_jax.comm import check_transport, resolve_comm
from sparcml_jax.comm.xla_transport import NAME as XLA
from sparcml_jax.kernels._common import cond_varying


def check_group(comm: Any, axis_name: Hashable | None, transport: str | None) -> None:
    """Raises, naming the argument, for a ``comm``/``axis_name``/``transport`` that cannot go together."""
    if axis_name is None:
        if transport is not None:
            check_transport(transport)
        return
    if comm is not None:
        raise ValueError("comm and axis_name are exclusive: pass comm= to sum across MPI ranks, or axis_name= "
                         "inside jax.shard_map over a mesh axis, not both")
    if transport not in (None, XLA):
        raise ValueError(f"transport={transport!r} is an MPI transport; over a mesh axis the collectives run on "
                         f"XLA's: leave transport=None (or pass {XLA!r})")


@dataclasses.dataclass(frozen=True)
class Group:
    """Resolved when a stage updates (a mesh axis is bound only inside ``shard_map``)."""

    comm: MPI.Comm | None
    axis_name: Hashable | None
    size: int

    @classmethod
    def of(cls, comm: MPI.Comm | None, axis_name: Hashable | None) -> "Group":
        if axis_name is None:
            comm = resolve_comm(comm)
            return cls(comm, None, comm.Get_size())
        try:
            return cls(None, axis_name, int(jax.lax.axis_size(axis_name)))
        except NameError:
            raise ValueError(f"axis_name={axis_name!r} names no mesh axis here: run the update inside "
                             "jax.shard_map (or jax.pmap) over that axis") from None

    @property
    def where(self) -> dict:
        """The keyword a collective takes to run over this group."""
        return {"comm": self.comm} if self.axis_name is None else {"axis_name": self.axis_name}

    def transport(self, transport: str | None) -> str | None:
        return ("native" if transport is None else transport) if self.axis_name is None else transport

    def cond(self, pred: Any, true_fun: Callable, false_fun: Callable, *operands: Any) -> Any:
        axes = frozenset() if self.axis_name is None else frozenset([self.axis_name])
        return cond_varying(pred, true_fun, false_fun, *operands, axes=axes)

    def max(self, x: jax.Array) -> jax.Array:
        if self.size == 1:
            return x
        if self.axis_name is not None:
            return jax.lax.pmax(x, self.axis_name)
        import mpi4jax

        return mpi4jax.allreduce(x, op=MPI.MAX, comm=self.comm)
