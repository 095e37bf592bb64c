"""What every algorithm needs to know about one call: static, identical on every rank."""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import NamedTuple

import jax
import jax.numpy as jnp
from mpi4py import MPI

ALGORITHMS = ("dense", "ssar_recursive_doubling", "ssar_split_allgather", "dsar_split_allgather")
QUANTIZE_BITS = (2, 4, 8)


def check_quantize_options(algorithm: str, quantize_bits: int, key) -> None:
    """QSGD applies to DSAR's dense phase and needs a key (raises ValueError naming the fix)."""
    if quantize_bits not in QUANTIZE_BITS:
        raise ValueError(f"quantize_bits must be one of {QUANTIZE_BITS} or None, got {quantize_bits!r}")
    if algorithm not in ("auto", "dsar_split_allgather"):
        raise ValueError(
            f"quantize_bits applies to the dense phase of 'dsar_split_allgather' (or 'auto'), not {algorithm!r}")
    if key is None:
        raise ValueError("quantize_bits needs key=: a PRNG key, fresh every step, for QSGD's stochastic rounding")


@dataclasses.dataclass(frozen=True)
class Plan:
    # mpi4py communicators are unhashable: plans hash and compare by the communicator's handle.
    comm: MPI.Comm = dataclasses.field(compare=False, hash=False)
    transport: ModuleType
    delta: float
    quantize_bits: int | None = None
    bucket_size: int = 1024
    quantize_scale: str = "max"
    comm_handle: int = -1

    def __post_init__(self):
        object.__setattr__(self, "comm_handle", self.comm.py2f())

    @property
    def rank(self) -> int:
        return self.comm.Get_rank()

    @property
    def nprocs(self) -> int:
        return self.comm.Get_size()


class AllreduceStats(NamedTuple):
    """What one sparse allreduce did on this rank (a pytree of scalars, safe to return from jit).

    Attributes:
      algorithm: int32 index into ``ALGORITHMS``.
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


class Progress(NamedTuple):
    """Carried through an algorithm's rounds: error status, bytes sent, first dense round."""

    status: jax.Array
    bytes_sent: jax.Array
    dense_round: jax.Array

    @classmethod
    def start(cls) -> "Progress":
        return cls(jnp.int32(0), jnp.float32(0), jnp.int32(-1))

    def after(self, round_index: int, status: jax.Array, sent: jax.Array, is_dense: jax.Array) -> "Progress":
        first_dense = jnp.where((self.dense_round < 0) & is_dense, jnp.int32(round_index), self.dense_round)
        return Progress(status, self.bytes_sent + sent, first_dense)
