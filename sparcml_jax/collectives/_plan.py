"""What every algorithm needs to know about one call: static, identical on every rank."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Callable, Hashable, NamedTuple

import jax
from mpi4py import MPI

from sparcml_jax.comm import communicator_id

# Every algorithm is a module of this package named after it, holding its one definition under
# that name; its index here is its code in AllreduceStats.algorithm.
ALGORITHMS = ("dense", "ssar_recursive_doubling", "ssar_split_allgather", "dsar_split_allgather", "sparse_ring")
# Their result is the dense vector. On both MPI transports they run on the native engine, which
# sends every segment at its fill and reduces dense vectors in place: static buffers send each
# segment at its capacity and stage copies of N values around every call (DSAR on them measured
# 2.3-6.0x the dense allreduce at 10-50 %, P = 4, N = 2^22).
ENGINE_ALGORITHMS = ("dense", "dsar_split_allgather")
# The global top-k allreduces (their result keeps about k entries, the rest goes to residuals).
GLOBAL_TOPK_ALGORITHMS = ("spardl", "gtopk", "oktopk")
QUANTIZE_BITS = (2, 4, 8)
QUANTIZE_SCALES = ("max", "l2")


def definition(name: str) -> Callable:
    """The definition of algorithm ``name``: ``f(transport, stream, **options) -> stream``, or
    for a global top-k one ``f(transport, x, k=k) -> (total, residual)``."""
    return getattr(importlib.import_module(f"sparcml_jax.collectives.{name}"), name)


@dataclasses.dataclass(frozen=True)
class Quantization:
    """QSGD on the wire of the dense phases: ``bits`` per value, one ``scale`` per bucket of
    values; with ``feedback`` the call also returns what the split phase's coding lost on this rank."""

    bits: int
    bucket_size: int = 1024
    scale: str = "max"
    feedback: bool = False


@dataclasses.dataclass(frozen=True)
class Plan:
    """One call's static choices, over an MPI communicator or a mesh axis (``axis_name``, of
    ``axis_size`` devices, with ``comm`` None). mpi4py communicators are unhashable: plans hash
    and compare by :func:`~sparcml_jax.comm.communicator_id`."""

    comm: MPI.Comm | None = dataclasses.field(compare=False, hash=False)
    transport: str
    delta: float
    quantize: Quantization | None = None
    value_bits: int = 32  # of the values on the wire: 16 for bfloat16
    comm_id: int = -1
    axis_name: Hashable | None = None
    axis_size: int = 0
    ordered: bool = True  # False: the native call carries no effect (comm.native.unordered_calls)

    def __post_init__(self):
        if self.comm is not None:
            object.__setattr__(self, "comm_id", communicator_id(self.comm))

    @property
    def rank(self) -> int:
        return self.comm.Get_rank()

    @property
    def nprocs(self) -> int:
        return self.axis_size if self.axis_name is not None else self.comm.Get_size()

    def options(self, algorithm: str) -> dict:
        """Keyword arguments of the algorithm's definition (QSGD for DSAR's dense phases)."""
        if algorithm != "dsar_split_allgather" or not self.quantize:
            return {}
        return {"quantize": self.quantize, "feedback": True} if self.quantize.feedback else {"quantize": self.quantize}


class AllreduceStats(NamedTuple):
    """What one sparse allreduce did on this rank (a pytree of scalars, safe to return from jit).

    Attributes:
      algorithm: int32 index into ``ALGORITHMS`` (-1 for an allgather).
      bytes_sent: float32 bytes this rank sent: the native transport's payloads (headers
        excluded), the mpi4jax transport's whole static messages (their 8-byte headers included).
        For allgathers it is this rank's message times the P - 1 ranks that receive it, and for
        the dense allreduce the reduce-scatter + allgather volume ``2 (P - 1) / P * 4 N``.
      result_nnz: int32 entries of the result (``size`` when dense).
      dense_round: int32 communication round after which this rank's data was dense, -1 if never.
    """

    algorithm: jax.Array
    bytes_sent: jax.Array
    result_nnz: jax.Array
    dense_round: jax.Array
