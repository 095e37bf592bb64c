"""``mpirun -n P python -m sparcml_jax.bench calibrate --out FILE``: measures the cost model of
``algorithm="auto"`` on the job's communicator and writes it as JSON. Point
``SPARCML_JAX_COST_MODEL`` at the file and later jobs on the same machines choose with it
instead of measuring it at their first ``auto`` call."""

from __future__ import annotations

import argparse
import dataclasses
import time

from sparcml_jax.collectives.cost_model import CostModel
from sparcml_jax.comm import resolve_comm


def main(argv: list[str] | None = None) -> CostModel:
    parser = argparse.ArgumentParser(prog="mpirun -n P python -m sparcml_jax.bench calibrate", description=__doc__)
    parser.add_argument("--out", required=True, help="the JSON file to write (rank 0)")
    args = parser.parse_args(argv)
    comm = resolve_comm(None)
    start = time.perf_counter()
    model = CostModel.calibrate(comm)
    seconds = time.perf_counter() - start
    if comm.Get_rank() == 0:
        model.save(args.out)
        terms = ", ".join(f"{name}={value:.3g}" for name, value in dataclasses.asdict(model).items())
        print(f"P={comm.Get_size()}: calibrated in {seconds:.2f} s: {terms}; written to {args.out}")
    return model
