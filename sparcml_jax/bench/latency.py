"""``mpirun -n P python -m sparcml_jax.bench latency``: the per-call cost of a small sparse
allreduce (16 entries of N = 4096) inside a jitted program, ten chained calls, against an mpi4jax
allreduce of a single float32 chained the same way; and the first call of each (tracing,
compilation and, for ``auto`` without a cost model, the calibration).

Each sample is the slowest rank's time of one program of ten calls, divided by ten; rows report
the median over repetitions (interleaved) and the ratio to the mpi4jax allreduce.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import mpi4jax
import numpy as np
from mpi4py import MPI

from sparcml_jax.bench._timing import fmt_time, print_table
from sparcml_jax.collectives import sparse_allreduce
from sparcml_jax.comm import resolve_comm
from sparcml_jax.stream import SparseStream

SIZE, ENTRIES, CALLS = 4096, 16, 10


def chained_dense(comm: MPI.Comm):
    @jax.jit
    def run(x):  # each call takes the previous result
        return jax.lax.fori_loop(0, CALLS, lambda i, x: mpi4jax.allreduce(x, op=MPI.SUM, comm=comm) * 0 + x, x)

    return run


def chained_sparse(comm: MPI.Comm, algorithm: str):
    @jax.jit
    def run(s: SparseStream):
        def body(i, carry):  # each call's input depends on the previous result (through its nnz)
            t = SparseStream(s.indices, s.values, jnp.minimum(s.nnz, s.nnz + carry.astype(jnp.int32)), s.size)
            return carry + 0 * sparse_allreduce(t, comm=comm, algorithm=algorithm).values[0]

        return jax.lax.fori_loop(0, CALLS, body, jnp.float32(0))

    return run


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="mpirun -n P python -m sparcml_jax.bench latency", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=300)
    parser.add_argument("--json", help="write the rows to this JSON file (rank 0)")
    args = parser.parse_args(argv)
    comm = resolve_comm(None)
    rank = comm.Get_rank()
    idx = np.sort(np.random.default_rng(rank).choice(SIZE, ENTRIES, replace=False)).astype(np.int32)
    stream = SparseStream(jnp.asarray(idx), jnp.ones(ENTRIES, jnp.float32), jnp.int32(ENTRIES), SIZE)
    cases = {"mpi4jax allreduce (1 float32)": (chained_dense(comm), jnp.ones(1, jnp.float32)),
             "ssar_recursive_doubling": (chained_sparse(comm, "ssar_recursive_doubling"), stream),
             "auto": (chained_sparse(comm, "auto"), stream)}
    first = {}
    for name, (program, arg) in cases.items():  # a named algorithm first: it must not calibrate
        comm.Barrier()
        start = time.perf_counter()
        jax.block_until_ready(program(arg))
        first[name] = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
        for _ in range(20):
            jax.block_until_ready(program(arg))
    samples = {name: [] for name in cases}
    for _ in range(args.reps):
        for name, (program, arg) in cases.items():
            comm.Barrier()
            start = time.perf_counter()
            jax.block_until_ready(program(arg))
            samples[name].append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX) / CALLS)
    base = float(np.median(samples["mpi4jax allreduce (1 float32)"]))
    rows = [dict(P=comm.Get_size(), case=name, median=float(np.median(v)), ratio=float(np.median(v)) / base,
                 first_call_s=first[name]) for name, v in samples.items()]
    if rank == 0:
        print_table(["P", "case", "per call (median)", "vs mpi4jax", "first call"],
                    [[r["P"], r["case"], fmt_time(r["median"]), f"{r['ratio']:.2f}", f"{r['first_call_s']:.2f} s"]
                     for r in rows])
        print(f"{ENTRIES} entries of N = {SIZE}, {CALLS} chained calls per jitted program; first call: tracing, "
              "compilation and, for auto without a cost model, the calibration")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    return rows
