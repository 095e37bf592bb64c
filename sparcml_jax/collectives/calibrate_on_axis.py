"""Measuring the cost model's terms over the devices of a mesh axis (``axis_name=``).

The terms of :class:`~sparcml_jax.collectives.cost_model.CostModel` as the XLA transport meets
them: every term is a jitted ``jax.shard_map`` program over the axis, all devices working at once
(devices that share cores or the memory bus are measured sharing them), past the caches. A
message is a ``ppermute`` between device pairs and the dense allreduce is ``psum``; a term's
time per call is the median over repetitions of a loop of calls inside one program, so that the
dispatch of a program is not counted as communication. Across processes (``jax.distributed``)
process 0's numbers are broadcast, so every process chooses the same algorithms.
"""

from __future__ import annotations

import time
from typing import Callable, Hashable

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sparcml_jax.collectives.calibrate import MERGE_PAIRS, merge_chain, merge_indices
from sparcml_jax.comm._compat import outside_trace

_CALLS = 8  # calls per program: the loop's time over them is one call's


def measure_on_axis(mesh: Mesh, axis_name: Hashable, reps: int = 7, large_bytes: int = 16 << 20) -> tuple[float, ...]:
    """(alpha, beta, dense_alpha, dense_beta, pair_cost, element_cost, select_cost) over the
    devices of ``axis_name`` of ``mesh``; see :class:`~sparcml_jax.CostModel`. Every process of
    the mesh must call it."""
    if axis_name not in mesh.axis_names:
        raise ValueError(f"axis_name={axis_name!r} is not an axis of the mesh (its axes: {mesh.axis_names})")
    nprocs = mesh.shape[axis_name]
    timer = _AxisTimer(mesh, axis_name, reps)
    large = large_bytes // 4

    def measure() -> list[float]:
        if nprocs > 1:
            pairs = [(d, d ^ 1) for d in range(nprocs) if d ^ 1 < nprocs]
            exchange = lambda v: jax.lax.ppermute(v, axis_name, pairs)  # noqa: E731
            alpha = max(timer.loop(exchange, 1), 1e-7)
            beta = max((timer.loop(exchange, large) - alpha) / large_bytes, 1e-12)
            mean = lambda v: jax.lax.psum(v, axis_name) * (1.0 / nprocs)  # noqa: E731
            dense_alpha = timer.loop(mean, 2)
            dense_beta = max((timer.loop(mean, large) - dense_alpha) / large_bytes, 1e-12)
        else:
            alpha = beta = dense_alpha = dense_beta = 0.0
        pair_cost, element_cost, select_cost = timer.compute_costs()
        numbers = np.asarray([alpha, beta, dense_alpha, dense_beta, pair_cost, element_cost, select_cost])
        return np.asarray(multihost_utils.broadcast_one_to_all(numbers)) if jax.process_count() > 1 else numbers

    # On a fresh thread: called while a step is traced, JAX's trace state (per thread) would
    # otherwise stage these programs into the step instead of running them.
    return tuple(float(v) for v in outside_trace(measure))


class _AxisTimer:
    """Times programs that run on every device of the axis at once."""

    def __init__(self, mesh: Mesh, axis_name: Hashable, reps: int):
        self.mesh, self.axis_name, self.reps = mesh, axis_name, reps
        self.per_device = NamedSharding(mesh, P(axis_name))

    def _median(self, program: Callable, *args) -> float:
        for _ in range(3):  # compile, and let the heaps grow
            jax.block_until_ready(program(*args))
        times = []
        for _ in range(self.reps):
            start = time.perf_counter()
            jax.block_until_ready(program(*args))
            times.append(time.perf_counter() - start)
        return float(np.median(times))

    def _on_axis(self, fn: Callable) -> Callable:
        return jax.jit(jax.shard_map(fn, mesh=self.mesh, in_specs=P(self.axis_name), out_specs=P(self.axis_name),
                                     check_vma=False))

    def _rows(self, width: int, fill: Callable[[int], np.ndarray] = lambda w: np.ones(w, np.float32)) -> jax.Array:
        """A vector of ``width`` values per device, ``fill(width)`` on each."""
        shape = (self.mesh.shape[self.axis_name] * width,)
        return jax.make_array_from_callback(shape, self.per_device, lambda index: fill(width))

    def loop(self, call: Callable, width: int) -> float:
        """Seconds per call of ``call`` on a vector of ``width`` float32 per device: ``_CALLS``
        dependent calls in one program, against the same program with none."""
        def chained(calls):
            return self._on_axis(lambda v: jax.lax.fori_loop(0, calls, lambda i, x: call(x), v))

        rows = self._rows(width)
        return max(self._median(chained(_CALLS), rows) - self._median(chained(0), rows), 0.0) / _CALLS

    def compute_costs(self) -> tuple[float, float, float]:
        """Per-pair merge cost, per-element pass cost and per-value selection cost, every device
        computing at once (the workloads of :func:`calibrate._compute_costs` and
        :func:`selection_cost.measure_select_cost`)."""
        from sparcml_jax.kernels.topk import topk

        rng = np.random.default_rng(0)
        indices = [self._rows(MERGE_PAIRS, lambda w: merge_indices(rng)) for _ in range(4)]
        merge_seconds = self._median(self._on_axis(merge_chain), *indices)
        element = 1 << 22
        pass_seconds = self._median(self._on_axis(lambda v: v * 2.0), self._rows(element))
        select_size = 1 << 21
        values = self._rows(select_size, lambda w: rng.random(w, np.float32) - 0.5)
        select_seconds = self._median(self._on_axis(lambda v: topk(v, select_size // 100).values), values)
        # A pass reads and writes each element.
        return merge_seconds / (8 * MERGE_PAIRS), pass_seconds / (2 * element), select_seconds / select_size
