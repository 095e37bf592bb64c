"""``algorithm="auto"``: the cheapest algorithm for a call by the cost model, and the model itself.

The model is needed only here: a call that names its algorithm never calibrates. ``auto`` takes
the model given to it, else the file named by ``SPARCML_JAX_COST_MODEL`` (written by
``python -m sparcml_jax.bench calibrate --out FILE``), else it measures the model once per
communicator, on every rank together.
"""

from __future__ import annotations

import os

from mpi4py import MPI

from sparcml_jax.collectives._plan import Plan
from sparcml_jax.collectives.cost_model import CostModel
from sparcml_jax.comm import STATIC_BUFFER_TRANSPORTS, communicator_id
from sparcml_jax.comm._compat import outside_trace
from sparcml_jax.stream import can_switch_to_dense, dense_threshold

COST_MODEL_ENV = "SPARCML_JAX_COST_MODEL"
# In order of preference on equal predicted cost.
CANDIDATES = ("ssar_recursive_doubling", "ssar_split_allgather", "sparse_ring", "dsar_split_allgather", "dense")
_calibrated: dict[int, CostModel] = {}


def price(model: CostModel, plan: Plan, name: str, size: int, capacity: int, nnz: float) -> float:
    """The predicted seconds, or infinity for SSAR once the expected sum is dense, which the model
    cannot price: SparCML hands a sum that fills in to DSAR (the uniform union bound of its
    appendix B reaches the dense switch); SSAR would carry a dense vector as streams through
    every round, measured at 3-17x the prediction (2^22 values, 50 %, P = 2, 4).

    The static-buffer transports (mpi4jax, xla) move whole buffers, so there the fill-in is that
    of the capacities (recursive doubling on mpi4jax, streams of capacity N at 10 %, P = 4: 168 ms
    against 21 ms dense).
    """
    cost = float(model.predict(name, size=size, nnz=nnz, nprocs=plan.nprocs, transport=plan.transport,
                               capacity=capacity, quantize_bits=plan.quantize and plan.quantize.bits,
                               delta=plan.delta, value_bits=plan.value_bits))
    if plan.nprocs == 1 or not name.startswith("ssar"):
        return cost
    n = max(size, 1)
    moved = capacity if plan.transport in STATIC_BUFFER_TRANSPORTS else nnz
    union = n * (1.0 - (1.0 - min(moved, n) / n) ** plan.nprocs)
    return float("inf") if union >= dense_threshold(size, plan.delta) else cost


def best(model: CostModel, plan: Plan, size: int, capacity: int, nnz: float) -> str:
    """The cheapest candidate. With QSGD, neither the float32 dense allreduce nor the ring (whose
    segments fill in as float32 slices): a caller who asks for b bits gets them wherever the data
    goes dense (quantized DSAR), and exact pairs where SSAR keeps it sparse."""
    names = [name for name in CANDIDATES if not (plan.quantize and name in ("dense", "sparse_ring"))]
    costs = {name: price(model, plan, name, size, capacity, nnz) for name in names}
    return min(costs, key=costs.get)


def choice_table(model: CostModel, plan: Plan, size: int, capacity: int, dense: bool = False) -> list[tuple[int, str]]:
    """(bound, algorithm) rows: the call runs the first row whose bound covers the largest nnz
    over ranks. One row is a choice made while tracing.

    A stream ``dense`` by construction has ``size`` entries on every rank: its choice is made
    while tracing, at that count.

    A capacity too small for the dense form was sized for the data (top-k streams fill it), so
    its price is the price. A capacity that allows the dense form says little about the actual
    count: a sparse winner at that bound stays the winner for fewer nonzeros, anything else is
    decided at run time on the global nnz, from the prices at powers of two. The static-buffer
    transports' prices depend on the capacities alone (they move whole buffers), so their choice
    is always made while tracing.
    """
    if dense:
        return [(capacity, best(model, plan, size, capacity, size))]
    at_capacity = best(model, plan, size, capacity, capacity)
    if (plan.transport in STATIC_BUFFER_TRANSPORTS or not can_switch_to_dense(capacity, size, plan.delta)
            or at_capacity.startswith("ssar")):
        return [(capacity, at_capacity)]
    grid = sorted({0, capacity} | {1 << i for i in range(capacity.bit_length()) if 1 << i < capacity})
    rows: list[tuple[int, str]] = []
    for bound in grid:
        name = best(model, plan, size, capacity, bound)
        if rows and rows[-1][1] == name:
            rows[-1] = (bound, name)
        else:
            rows.append((bound, name))
    return rows


def calibrates(comm: MPI.Comm, given: CostModel | None = None) -> bool:
    """Whether :func:`cost_model_for` will measure on ``comm`` (a collective call on every rank)."""
    return given is None and not os.environ.get(COST_MODEL_ENV) and communicator_id(comm) not in _calibrated


def cost_model_for(comm: MPI.Comm, given: CostModel | None = None) -> CostModel:
    """The model ``auto`` chooses with on ``comm`` (see the module's docstring)."""
    if calibrates(comm, given):
        _calibrated[communicator_id(comm)] = outside_trace(lambda: CostModel.calibrate(comm))
    if given is not None:
        return given
    path = os.environ.get(COST_MODEL_ENV)
    return CostModel.load(path) if path else _calibrated[communicator_id(comm)]
