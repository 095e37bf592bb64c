"""Overlap benchmark (run under mpirun): how much of a sparse allreduce a computation hides.

One reduction and one independent computation of about the same duration, measured in the same
run, interleaved:

* ``reduce``: start + wait alone (the engine's time), and ``blocking``: ``sparse_allreduce`` alone;
* ``compute``: the computation alone (a chain of matmuls, sized to match ``reduce``);
* ``sequential``: blocking reduction and computation in one jitted program;
* ``overlapped``: start, compute, ``wait(after=computation)`` in one jitted program;
* ``unpinned``: the same without ``after=``, which leaves the order to XLA's scheduler.

Hidden fraction = (reduce + compute - overlapped) / reduce: 1 means the reduction was free.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from sparcml_jax.bench._timing import fmt_time, print_table
from sparcml_jax.bench.allreduce import _timed, make_stream
from sparcml_jax.collectives import sparse_allreduce
from sparcml_jax.collectives.nonblocking import sparse_allreduce_start, sparse_allreduce_wait
from sparcml_jax.comm import resolve_comm

MATRIX = 256


def _compute_fn(steps: int):
    w = jnp.asarray(np.random.default_rng(0).standard_normal((MATRIX, MATRIX)).astype(np.float32) / 16)

    def compute(a):
        return jax.lax.fori_loop(0, steps, lambda i, a: jnp.tanh(a @ w), a)

    return compute


def programs(algorithm: str, steps: int) -> dict:
    compute = _compute_fn(steps)

    def overlapped(s, a):
        handle = sparse_allreduce_start(s, algorithm=algorithm)
        y = compute(a)
        return sparse_allreduce_wait(handle, after=y), y

    def unpinned(s, a):
        handle = sparse_allreduce_start(s, algorithm=algorithm)
        y = compute(a)
        return sparse_allreduce_wait(handle), y

    return {
        "reduce": jax.jit(lambda s, a: sparse_allreduce_wait(sparse_allreduce_start(s, algorithm=algorithm))),
        "blocking": jax.jit(lambda s, a: sparse_allreduce(s, algorithm=algorithm)),
        "compute": jax.jit(lambda s, a: compute(a)),
        "sequential": jax.jit(lambda s, a: (sparse_allreduce(s, algorithm=algorithm), compute(a))),
        "overlapped": jax.jit(overlapped),
        "unpinned": jax.jit(unpinned),
    }


def _median_ms(comm, fn, args, reps):
    return statistics.median(_timed(comm, lambda: fn(*args), reps)) * 1e3


def calibrate_steps(comm, a, target_ms: float) -> int:
    """Matmul steps whose time is about ``target_ms`` (the same on every rank)."""
    steps = 8
    for _ in range(3):  # the cost per step is not quite constant (caches, thread start-up): refine
        fn = jax.jit(_compute_fn(steps))
        jax.block_until_ready(fn(a))
        ms = _median_ms(comm, fn, (a,), 7)
        steps = max(1, round(steps * target_ms / max(ms, 1e-3)))
    return steps


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="mpirun -n P python -m sparcml_jax.bench overlap", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, default=1 << 22)
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--algorithm", default="ssar_split_allgather")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--json", help="write the results to this JSON file (rank 0)")
    p.add_argument("--network", default="shm", help="label of the network in the output")
    p.add_argument("--compute-steps", type=int, help="matmul steps of the computation (default: calibrated to "
                                                        "the reduction's time)")
    p.add_argument("--quick", action="store_true", help="N = 2^18 and 3 repetitions (a smoke run)")
    args = p.parse_args(argv)
    if args.quick:
        args.size, args.reps = 1 << 18, 3

    comm = resolve_comm(None)
    rank, nprocs = comm.Get_rank(), comm.Get_size()
    k = max(1, math.ceil(args.density * args.size))
    stream = make_stream(args.size, k, "uniform", rank, nprocs)
    a = jnp.ones((MATRIX, MATRIX), jnp.float32)
    reduce_only = jax.jit(lambda s: sparse_allreduce_wait(sparse_allreduce_start(s, algorithm=args.algorithm)))
    reduce_only(stream)
    steps = args.compute_steps or calibrate_steps(comm, a, _median_ms(comm, reduce_only, (stream,), 7))
    progs = programs(args.algorithm, steps)
    for fn in progs.values():
        jax.block_until_ready(fn(stream, a))

    samples: dict[str, list[float]] = {name: [] for name in progs}
    for _ in range(args.reps):  # interleaved, so that machine noise hits every program alike
        for name, fn in progs.items():
            samples[name] += _timed(comm, lambda: fn(stream, a), 1)
    med = {name: statistics.median(v) for name, v in samples.items()}
    hidden = (med["reduce"] + med["compute"] - med["overlapped"]) / med["reduce"]
    hidden_unpinned = (med["reduce"] + med["compute"] - med["unpinned"]) / med["reduce"]
    if rank == 0:
        print(f"P={nprocs}  N={args.size}  density={args.density}  {args.algorithm}  network={args.network}  "
              f"compute={steps} matmul steps  reps={args.reps} (each time: max over ranks)")
        print_table(["program", "median", "min", "max"],
                    [[name, fmt_time(med[name]), fmt_time(min(v)), fmt_time(max(v))] for name, v in samples.items()])
        print(f"hidden fraction of the reduction: {hidden:.2f} with wait(after=...), {hidden_unpinned:.2f} without; "
              f"overlapped / sequential = {med['overlapped'] / med['sequential']:.2f}; "
              f"compute / reduce = {med['compute'] / med['reduce']:.2f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(nprocs=nprocs, size=args.size, density=args.density, algorithm=args.algorithm,
                               network=args.network, compute_steps=steps, reps=args.reps, samples=samples,
                               median=med, hidden=hidden, hidden_unpinned=hidden_unpinned), f, indent=1)


if __name__ == "__main__":
    main()
