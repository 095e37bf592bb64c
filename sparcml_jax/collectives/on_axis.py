"""The collectives over a mesh axis (``axis_name=``): the same definitions on the XLA transport
(:mod:`sparcml_jax.comm.xla_transport`), inside ``jax.shard_map`` or ``jax.pmap``.

One program runs on every device of the axis, so its static choices (the algorithm, the
capacities, the cost model's pick) are the same on every device by construction, and
:func:`~sparcml_jax.comm.xla_transport.agree` checks every device's data before any message.
Across processes (``jax.distributed``) every process traces the same call, as for any XLA
collective.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Hashable

import jax
import jax.numpy as jnp
import numpy as np

from sparcml_jax.collectives._plan import ALGORITHMS, AllreduceStats, Plan, Quantization, definition
from sparcml_jax.collectives.auto import COST_MODEL_ENV, choice_table
from sparcml_jax.collectives.cost_model import CostModel
from sparcml_jax.collectives.group import check_group
from sparcml_jax.comm.xla_transport import NAME, XlaTransport, agree
from sparcml_jax.stream import SparseStream, with_indices


def axis_plan(axis_name: Hashable, comm: Any, transport: str | None, delta: float,
              quantize: Quantization | None = None, value_bits: int = 32) -> Plan:
    """The plan of a call over ``axis_name``; raises ValueError naming the argument otherwise."""
    check_group(comm, axis_name, transport)
    try:
        size = jax.lax.axis_size(axis_name)
    except NameError:
        raise ValueError(f"axis_name={axis_name!r} names no mesh axis here: call the collective inside "
                         "jax.shard_map (or jax.pmap) over that axis") from None
    return Plan(None, NAME, float(delta), quantize, value_bits, axis_name=axis_name, axis_size=int(size))


def cost_model_on_axis(given: CostModel | None, nprocs: int) -> CostModel:
    """The model ``auto`` chooses with over a mesh axis of ``nprocs`` devices: the one given,
    else the file named by ``SPARCML_JAX_COST_MODEL``, else, for an axis over all of JAX's
    devices (a data-parallel mesh), one measured over them at the first such call."""
    if given is not None:
        return given
    path = os.environ.get(COST_MODEL_ENV)
    if path:
        return CostModel.load(path)
    if nprocs == jax.device_count():
        return _calibrated_over_every_device(nprocs)
    raise ValueError(f"algorithm='auto' over a mesh axis of {nprocs} of the {jax.device_count()} devices chooses with "
                     "a cost model: pass cost_model= (for example CostModel.calibrate_on_axis(mesh, axis_name) outside "
                     "the shard_map, or CostModel.load(path) of `python -m sparcml_jax.bench calibrate --axis NAME "
                     f"--out FILE`), set {COST_MODEL_ENV}, or name the algorithm (e.g. algorithm='ssar_split_allgather')")


@functools.cache
def _calibrated_over_every_device(nprocs: int) -> CostModel:
    """Measured while the first ``auto`` call is traced (on a fresh thread, outside the trace);
    every process traces that call, so every process measures, and takes process 0's numbers."""
    mesh = jax.make_mesh((nprocs,), ("sparcml_jax_calibration",))
    return CostModel.calibrate_on_axis(mesh, "sparcml_jax_calibration")


def same_everywhere(value: jax.Array, axis_name: Hashable, name: str) -> jax.Array:
    """``value`` (an int32 scalar), checked to be the same on every device of the axis, typed as
    such: a branch it decides then runs on every device alike."""
    gathered = jax.lax.all_gather(value, axis_name, to="invarying")

    def check(gathered: np.ndarray) -> np.ndarray:
        gathered = np.asarray(gathered)
        if np.any(gathered != gathered[0]):
            raise ValueError(f"{name} differs between the devices of axis {axis_name!r} ({gathered.tolist()}); "
                             "every device must carry the same state from step to step")
        return np.zeros((), gathered.dtype)

    return gathered[0] + jax.pure_callback(check, jax.ShapeDtypeStruct((), gathered.dtype), gathered)


def choose(plan: Plan, algorithm: str, model: CostModel | None, size: int, capacity: int, dense: bool = False) -> str:
    if algorithm != "auto":
        return algorithm
    if plan.nprocs == 1:
        return "ssar_recursive_doubling"
    (_, name), = choice_table(model, plan, size, capacity, dense)  # static buffers: one choice, made while tracing
    return name


def allreduce(plan: Plan, algorithm: str, model: CostModel | None, stream: SparseStream,
              key: jax.Array | None) -> tuple[SparseStream, AllreduceStats, jax.Array | None]:
    """(The sum, its stats, this device's coding error when the plan asks for it, else None.)"""
    name = choose(plan, algorithm, model, stream.size, stream.capacity, stream.dense_by_construction)
    t = XlaTransport(plan.axis_name, plan.nprocs, plan.delta, stream.size, agree(stream, plan.axis_name), key,
                     plan.value_bits)
    out = definition(name)(t, stream if name == "dense" else with_indices(stream), **plan.options(name))
    result, error = out if isinstance(out, tuple) else (out, None)
    result = t.as_result(result)
    if error is not None:
        error = error.to_dense()
    elif plan.quantize and plan.quantize.feedback:  # an exact algorithm: nothing lost
        error = jnp.zeros((stream.size,), jnp.float32)
    return result, AllreduceStats(jnp.int32(ALGORITHMS.index(name)), t.sent, result.nnz, t.dense_round), error


def allgather(plan: Plan, stream: SparseStream) -> tuple[SparseStream, AllreduceStats]:
    t = XlaTransport(plan.axis_name, plan.nprocs, plan.delta, stream.size, agree(stream, plan.axis_name))
    result = t.gather(with_indices(stream))
    return result, AllreduceStats(jnp.int32(-1), t.sent, result.nnz, jnp.int32(-1))
