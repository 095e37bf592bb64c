"""``mpirun -n P python -m sparcml_jax.bench calibrate --out FILE``: measures the cost model of
``algorithm="auto"`` on the job's communicator and writes it as JSON. Point
``SPARCML_JAX_COST_MODEL`` at the file and later jobs on the same machines choose with it
instead of measuring it at their first ``auto`` call.

``python -m sparcml_jax.bench calibrate --axis data --out FILE`` measures it instead over a mesh
axis of all of JAX's devices (every process of a ``jax.distributed`` job runs it), for
``algorithm="auto"`` with ``axis_name=`` (see :meth:`CostModel.calibrate_on_axis`)."""

from __future__ import annotations

import argparse
import dataclasses
import time

from sparcml_jax.collectives.cost_model import CostModel
from sparcml_jax.comm import resolve_comm


def main(argv: list[str] | None = None) -> CostModel:
    parser = argparse.ArgumentParser(prog="mpirun -n P python -m sparcml_jax.bench calibrate", description=__doc__)
    parser.add_argument("--out", required=True, help="the JSON file to write (rank 0)")
    parser.add_argument("--axis", metavar="NAME",
                        help="measure over a mesh axis of this name spanning all of JAX's devices, not over MPI")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    if args.axis:
        import jax

        model = CostModel.calibrate_on_axis(jax.make_mesh((jax.device_count(),), (args.axis,)), args.axis)
        nprocs, writer = jax.device_count(), jax.process_index() == 0
    else:
        comm = resolve_comm(None)
        model = CostModel.calibrate(comm)
        nprocs, writer = comm.Get_size(), comm.Get_rank() == 0
    seconds = time.perf_counter() - start
    if writer:
        model.save(args.out)
        terms = ", ".join(f"{name}={value:.3g}" for name, value in dataclasses.asdict(model).items())
        print(f"P={nprocs}: calibrated in {seconds:.2f} s: {terms}; written to {args.out}")
    return model
