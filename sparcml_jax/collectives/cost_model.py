"""The alpha-beta cost model behind ``algorithm="auto"`` (SparCML §5.3 and Appendix B).

A message of ``b`` bytes costs ``alpha + b * beta``. Result density follows the uniform union
bound: ``m`` streams of ``k`` random nonzeros out of ``N`` cover ``N (1 - (1 - k/N)^m)`` indices.
Pairs cost 8 bytes and dense values 4, so every stream is priced at ``min(8 nnz, 4 N)``.
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np
from mpi4py import MPI

from sparcml_jax.comm.topology import lower_power_of_two


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Latency ``alpha`` (seconds per message) and inverse bandwidth ``beta`` (seconds per byte)."""

    alpha: float
    beta: float

    @classmethod
    def calibrate(cls, comm: MPI.Comm, small_reps: int = 50, large_bytes: int = 1 << 20, large_reps: int = 5) -> "CostModel":
        """Measures alpha and beta by a ping-pong between ranks 0 and 1; every rank gets rank 0's numbers."""
        if comm.Get_size() < 2:
            return cls(alpha=0.0, beta=0.0)
        small, large = np.zeros(1, np.float64), np.zeros(large_bytes // 8, np.float64)
        t_small, t_large = _ping_pong(comm, small, small_reps), _ping_pong(comm, large, large_reps)
        alpha = max(t_small, 1e-7)
        beta = max((t_large - alpha) / large_bytes, 1e-12)
        return cls(*comm.bcast((alpha, beta), root=0))

    def message(self, nbytes, xp=np):
        return self.alpha + nbytes * self.beta

    def predict(self, algorithm: str, *, size: int, nnz, nprocs: int, transport: str = "native",
                capacity: int | None = None, quantize_bits: int | None = None, xp=np):
        """Predicted seconds of one allreduce; ``nnz`` is the largest per-rank count (scalar or traced)."""
        n, p = float(size), nprocs
        if p == 1:
            return xp.asarray(0.0)
        static = transport == "mpi4jax"
        k = xp.asarray(float(capacity) if static and capacity is not None else nnz, dtype=xp.float32)
        dense_bytes = 4.0 * n

        def union(m):
            return n * (1.0 - (1.0 - xp.minimum(k, n) / max(n, 1.0)) ** m)

        def stream_bytes(m):
            count = xp.minimum(k * m, n) if static else union(m)
            return xp.minimum(8.0 * count, dense_bytes)

        log_p = math.log2(p)
        if algorithm == "dense":
            return 2 * log_p * self.alpha + 2 * (p - 1) / p * dense_bytes * self.beta
        if algorithm == "ssar_recursive_doubling":
            lower = lower_power_of_two(p)
            folded = 2 if lower < p else 1
            cost = 0.0
            if lower < p:
                cost = cost + self.message(stream_bytes(1), xp) + self.message(stream_bytes(p), xp)
            m = folded
            while m < folded * lower:
                cost = cost + self.message(stream_bytes(m), xp)
                m *= 2
            return cost
        split_phase = (p - 1) * self.message(stream_bytes(1) / p, xp)
        if algorithm == "ssar_split_allgather":
            return split_phase + log_p * self.alpha + (p - 1) * stream_bytes(p) / p * self.beta
        if algorithm == "dsar_split_allgather":
            value_bytes = 4.0 if quantize_bits is None else quantize_bits / 8.0
            return split_phase + log_p * self.alpha + (p - 1) * n / p * value_bytes * self.beta
        raise ValueError(f"unknown algorithm {algorithm!r}")


def _ping_pong(comm: MPI.Comm, buf: np.ndarray, reps: int) -> float:
    """Median one-way time of ``buf`` between ranks 0 and 1 (other ranks wait at the barrier)."""
    rank = comm.Get_rank()
    times = []
    comm.Barrier()
    for _ in range(reps + 1):
        start = time.perf_counter()
        if rank == 0:
            comm.Send(buf, dest=1, tag=77)
            comm.Recv(buf, source=1, tag=77)
        elif rank == 1:
            comm.Recv(buf, source=0, tag=77)
            comm.Send(buf, dest=0, tag=77)
        times.append((time.perf_counter() - start) / 2)
    comm.Barrier()
    return float(np.median(times[1:]))
