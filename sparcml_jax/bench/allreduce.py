"""Allreduce benchmark (run under mpirun): every SparCML algorithm and transport beside the
baselines, measured in the same run and interleaved so that machine noise hits all of them alike.

Each timed sample is the maximum over ranks of one call (ranks start together after a barrier);
rows report the median, min and max of those samples and the ratio to the dense mpi4jax
allreduce measured in the same run. With ``--calls-per-sample R`` a sample is R calls in one
jitted program, divided by R: the cost of a collective inside a training step, without the
dispatch of a jitted call per collective (0.2 ms per rank at P = 2, 0.55 ms at P = 4 here). Rows
also record the CPU time the hypervisor took during their cell and the page faults per call of
their slowest rank, the two usual suspects when a row runs slow, and the cost model's prediction.
``auto`` is judged by one number: its time over the best fixed algorithm's on its transport.

``--sweep global-topk`` sets the global top-k allreduces (SparDL, gTop-k, Ok-Topk) beside SparCML's
algorithms on the same input, every rank's dense random accumulator ``x`` with a budget of
``k = density N`` entries: the global ones get ``x`` and ``k``, SparCML's get ``topk(x, k)``.
Rows say what their time starts from (``timed_from``): ``x`` rows include the local top-k
selection, as a training step pays it; SparCML's ``stream`` rows time its collective alone.

With more ranks than cores, run the ranks under ``tools/short_slice.py`` (see there).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import os
import resource
import sys
import time

import jax
import jax.numpy as jnp
import mpi4jax
import numpy as np
from mpi4py import MPI

from sparcml_jax.bench._timing import block, fmt_time, print_table, repeated_in_one_program
from sparcml_jax.collectives import ALGORITHMS, CostModel, dense_allreduce, sparse_allgather, sparse_allreduce
from sparcml_jax.collectives._plan import GLOBAL_TOPK_ALGORITHMS, QUANTIZE_BITS
from sparcml_jax.collectives.auto import cost_model_for
from sparcml_jax.collectives.global_topk import GlobalTopkStats, global_topk_allreduce
from sparcml_jax.comm import resolve_comm
from sparcml_jax.kernels.partition import scatter_add
from sparcml_jax.kernels.topk import topk
from sparcml_jax.stream import SparseStream, dense_threshold

# "topk": each rank's stream is the top k of its own dense random accumulator (make_accumulator).
SUPPORTS = ("uniform", "identical", "disjoint", "powerlaw", "topk")
QUANTIZING = ("dsar_split_allgather", "auto")  # the algorithms that take quantize_bits
# SparCML's algorithms measured beside the global top-k ones (the dense baseline runs anyway).
SPARCML_BESIDE_GLOBAL_TOPK = ("auto", "ssar_recursive_doubling", "ssar_split_allgather", "dsar_split_allgather",
                              "sparse_ring")


def make_stream(size: int, k: int, support: str, rank: int, nprocs: int, seed: int = 0) -> SparseStream:
    """A rank's k-sparse stream with the given support pattern (values are small integers): k
    pairs, or from SparCML's dense switch on (``8 k >= 4 N``) the dense vector without indices
    (:meth:`SparseStream.dense`)."""
    rng = np.random.default_rng(seed + (0 if support == "identical" else 1000 + rank))
    if support in ("uniform", "identical"):
        idx = rng.choice(size, k, replace=False)
    elif support == "disjoint":
        base = np.random.default_rng(seed).permutation(size)[: k * nprocs] if k * nprocs <= size else None
        idx = base[rank * k:(rank + 1) * k] if base is not None else rng.choice(size, k, replace=False)
    elif support == "powerlaw":  # Zipf-like popularity: low indices are shared by most ranks
        weights = 1.0 / np.arange(1, size + 1) ** 1.1
        idx = rng.choice(size, k, replace=False, p=weights / weights.sum())
    else:
        raise ValueError(f"support must be one of {SUPPORTS}, got {support!r}")
    idx = np.sort(idx).astype(np.int32)
    values = rng.integers(1, 8, k).astype(np.float32)
    if k >= dense_threshold(size):
        x = np.zeros(size, np.float32)
        x[idx] = values
        return SparseStream.dense(jnp.asarray(x))
    return SparseStream(jnp.asarray(idx), jnp.asarray(values), jnp.int32(k), size)


def make_accumulator(size: int, rank: int, seed: int = 0) -> jax.Array:
    """A rank's dense float32 accumulator (gradient plus residual): standard normal, its own seed."""
    return jnp.asarray(np.random.default_rng(seed + 1000 + rank).standard_normal(size, dtype=np.float32))


def allgather_then_densify(s: SparseStream, *, comm: MPI.Comm) -> jax.Array:
    """The sum as DGC and GRACE form it: every rank's stream gathered by the framework's
    allgather (whole static buffers), each added into one dense vector (GRACE decompresses every
    stream to its own dense tensor first; one accumulator is kinder to it). ``naive
    allgather+sum`` is the sparse variant, merging the gathered streams."""
    idx = mpi4jax.allgather(s.indices, comm=comm)
    val = mpi4jax.allgather(s.values, comm=comm)
    nnz = mpi4jax.allgather(s.nnz[None], comm=comm)
    total = jnp.zeros((s.size,), jnp.float32)
    for r in range(comm.Get_size()):
        total = scatter_add(SparseStream(idx[r], val[r], nnz[r, 0], s.size), total)
    return total


def _steal_seconds() -> float | None:
    """CPU time the hypervisor took from this machine's vCPUs so far (Linux ``/proc/stat``), or None."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def _timed(comm: MPI.Comm, fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        comm.Barrier()
        start = time.perf_counter()
        block(fn())
        out.append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
    return out


def scenarios(kind: str) -> list[tuple[int, float, str]]:
    """(N, per-rank density, support) cells of a sweep.

    ``full`` covers growth with density at two sizes, growth with N at 1 %, and every support
    pattern where SparCML's algorithms differ most; ``issue`` is the 2^22 table from 0.1 % into
    the dense regime (30 %, and 50 %, where the streams are dense); ``global-topk`` the 2^22 table of the global top-k issue (each rank's
    top k of its own dense accumulator); ``quick`` is a smoke run.
    """
    if kind == "global-topk":
        return [(1 << 22, d, "topk") for d in (0.001, 0.01)]
    if kind == "quick":
        return [(1 << 14, 0.01, "uniform"), (1 << 14, 0.3, "uniform")]
    if kind == "issue":
        return [(1 << 22, d, "uniform") for d in (0.001, 0.01, 0.1, 0.3, 0.5)]
    if kind == "full":
        cells = [(n, d, "uniform") for n in (1 << 18, 1 << 22) for d in (1e-4, 1e-3, 1e-2, 0.1, 0.5)]
        cells += [(n, 0.01, "uniform") for n in (1 << 16, 1 << 20, 1 << 24)]
        cells += [(1 << 22, d, s) for s in ("identical", "disjoint", "powerlaw") for d in (1e-3, 1e-2)]
        return cells
    raise ValueError(f"unknown sweep {kind!r}")


def run(cells, algorithms, transports, reps, comm=None, baselines=True, progress=None, calls_per_sample=1,
        model=None, global_topk=(), bits=(), bfloat16=False):
    """The rows of every cell: each of ``algorithms`` (SparCML's) and ``global_topk`` on each of
    ``transports``, beside the dense baseline (and with ``baselines`` the allgather and mpi4py
    ones), each of those of ``algorithms`` that take QSGD once more per ``bits`` (labelled
    ``"dsar_split_allgather/q4"``), with ``bfloat16`` each once more with bfloat16 values
    (``"dense/bf16"``), and the cost model used for ``auto`` and the predictions."""
    comm = resolve_comm(comm)
    rank, nprocs = comm.Get_rank(), comm.Get_size()
    model = cost_model_for(comm, model)
    rows = []
    for cell_index, (size, density, support) in enumerate(cells):
        k = max(1, int(round(size * density)))
        if progress:
            progress(cell_index, len(cells), f"N=2^{int(math.log2(size))} density={density:.2%} {support}")
        if support == "topk":
            x = make_accumulator(size, rank)
            s = topk(x, k)
        else:
            s = make_stream(size, k, support, rank, nprocs)
            x = s.to_dense()
        cases = _cases(s, x, k, algorithms, global_topk, transports, comm, model, baselines,
                       sparcml_from_x=support == "topk", bits=bits, bfloat16=bfloat16)
        stats, timed = _compiled_cases(cases, calls_per_sample)
        samples, faults, steal = _interleaved_samples(comm, timed, reps, calls_per_sample)
        cell = dict(P=nprocs, N=size, density=density, support=support, calls_per_sample=calls_per_sample,
                    steal_seconds=steal)
        rows += _cell_rows(cell, samples, stats, faults, comm, model, k, reps)
    if progress:
        progress(len(cells), len(cells), "done")
    return rows, model


def _cases(s, x, k, algorithms, global_topk, transports, comm, model, baselines, sparcml_from_x=False,
           bits=(), bfloat16=False) -> dict:
    """(name, transport, timed from) -> (jittable call, its arguments), or (None, a call outside
    JAX). A call that reports stats returns ``(result, stats)``. ``timed from`` is ``"stream"``
    (the call gets this rank's stream ``s``) or ``"x"`` (the dense vector ``x``; with
    ``sparcml_from_x``, SparCML's algorithms are also timed from ``x``, selecting ``topk(x, k)``
    inside the call)."""
    cases = {("dense mpi4jax", "-", "x"): (lambda x: dense_allreduce(x, comm=comm), (x,))}
    if baselines:
        host = np.array(x)
        host_sum = np.empty_like(host)
        cases[("mpi4py Allreduce (numpy)", "-", "x")] = (None, lambda: comm.Allreduce(host, host_sum, op=MPI.SUM))
        for transport in transports:
            cases[("naive allgather+sum", transport, "stream")] = (
                lambda s, t=transport: sparse_allgather(s, comm=comm, transport=t, return_stats=True), (s,))
        cases[("allgather+dense sum (DGC)", "mpi4jax", "stream")] = (
            lambda s: allgather_then_densify(s, comm=comm), (s,))
    key = jax.random.key(0)  # an operand of the call: the same cost as a fresh key every step
    for transport in transports:
        variants = ([(a, None, None) for a in algorithms] + [(a, b, None) for b in bits for a in algorithms
                                                            if a in QUANTIZING]
                    + [(a, None, jnp.bfloat16) for a in algorithms if bfloat16])
        for algorithm, b, value_dtype in variants:
            def sparcml(s, a=algorithm, t=transport, b=b, v=value_dtype):
                return sparse_allreduce(s, comm=comm, algorithm=a, transport=t, cost_model=model, return_stats=True,
                                        quantize_bits=b, key=None if b is None else key, value_dtype=v)

            label = algorithm + ("" if b is None else f"/q{b}") + ("" if value_dtype is None else "/bf16")
            cases[(label, transport, "stream")] = (sparcml, (s,))
            if sparcml_from_x:
                cases[(label, transport, "x")] = (lambda x, sparcml=sparcml: sparcml(topk(x, k)), (x,))
        for algorithm in global_topk:
            cases[(algorithm, transport, "x")] = _global_topk_case(algorithm, transport, x, k, comm)
    return cases


def _global_topk_case(algorithm: str, transport: str, x, k: int, comm):
    """A global top-k allreduce of ``x`` as a case: the call returns ``((total, residual, ...), stats)``.

    Ok-Topk is timed on a step between its re-evaluations, as most of its steps run (127 of 128
    with the default ``tau``): the state after one first step, whose exact thresholds and
    balanced regions the timed calls carry.
    """
    options = dict(algorithm=algorithm, comm=comm, transport=transport)
    if algorithm == "oktopk":
        from sparcml_jax.collectives.global_topk import init_oktopk_state

        _, _, state = global_topk_allreduce(x, k, oktopk_state=init_oktopk_state(comm), **options)

        def stepped(x, state):
            total, residual, next_state, stats = global_topk_allreduce(x, k, oktopk_state=state, return_stats=True,
                                                                       **options)
            return (total, residual, next_state), stats

        return stepped, (x, state)

    def call(x):
        total, residual, stats = global_topk_allreduce(x, k, return_stats=True, **options)
        return (total, residual), stats

    return call, (x,)


def _compiled_cases(cases: dict, calls_per_sample: int) -> tuple[dict, dict]:
    """Compiles and warms up every case: (its stats where it reports them, a timed call per case)."""
    stats, timed = {}, {}
    for name, (call, args) in cases.items():
        if call is None:  # outside JAX: `args` is the call itself
            timed[name] = lambda run=args: [run() for _ in range(calls_per_sample)]
            continue
        single = jax.jit(call)
        first = block(single(*args))
        if isinstance(first, tuple) and len(first) == 2 and hasattr(first[1], "bytes_sent"):
            stats[name] = first[1]
        program = single if calls_per_sample == 1 else repeated_in_one_program(call, calls_per_sample)
        timed[name] = lambda program=program, args=args: program(*args)
        block(timed[name]())
    return stats, timed


def _interleaved_samples(comm, timed: dict, reps: int, calls_per_sample: int):
    """Per case its per-call times and minor page faults, over ``reps`` interleaved repetitions;
    and the CPU time the hypervisor took meanwhile (None where unknown)."""
    samples, faults = {name: [] for name in timed}, {name: 0 for name in timed}
    steal_before = _steal_seconds()
    for rep in range(reps):  # interleaved, so that noise hits every case alike
        # A new order every repetition (the same on every rank): a case must not always follow
        # the one that leaves the most memory to give back (DSAR, the dense baselines).
        order = list(timed)
        np.random.default_rng(rep).shuffle(order)
        for name in order:
            faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            samples[name] += [t / calls_per_sample for t in _timed(comm, timed[name], 1)]
            faults[name] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before
    steal_after = _steal_seconds()
    steal = None if steal_before is None or steal_after is None else steal_after - steal_before
    return samples, faults, steal


def _cell_rows(cell: dict, samples: dict, stats: dict, faults: dict, comm, model, k: int, reps: int) -> list[dict]:
    """One row per case of a cell: times, ratios to dense, bytes, result density and the prediction."""
    size, nprocs = cell["N"], cell["P"]
    dense_median = float(np.median(samples[("dense mpi4jax", "-", "x")]))
    rows = []
    for name, times in samples.items():
        st = stats.get(name)
        sparcml_stats = st is not None and not isinstance(st, GlobalTopkStats)
        chosen = ALGORITHMS[int(st.algorithm)] if sparcml_stats and int(st.algorithm) >= 0 else None
        sent = comm.allreduce(float(st.bytes_sent), op=MPI.MAX) if st is not None else None
        algorithm, _, variant = name[0].partition("/")
        bits = int(variant[1:]) if variant.startswith("q") else None
        value_bits = 16 if variant == "bf16" else 32
        if name[2] == "x" and (algorithm in ALGORITHMS or algorithm == "auto"):
            predicted = None  # the model prices the collective, not the selection before it
        elif algorithm in ALGORITHMS or algorithm == "auto":
            predicted = float(model.predict(chosen or algorithm, size=size, nnz=k, nprocs=nprocs,
                                            transport=name[1], capacity=k, quantize_bits=bits,
                                            value_bits=value_bits))
        elif name[0].startswith("dense") or name[0].startswith("mpi4py"):  # MPI_Allreduce of a dense vector
            predicted = model.dense_alpha + 4.0 * size * model.dense_beta if nprocs > 1 else 0.0
        else:
            predicted = None
        rows.append(dict(
            cell, algorithm=name[0], quantize_bits=bits, value_bits=value_bits if sparcml_stats else None,
            transport=name[1], timed_from=name[2], chosen=chosen,
            median=float(np.median(times)), min=float(np.min(times)), max=float(np.max(times)),
            ratio_to_dense=float(np.median(times)) / dense_median,
            bytes_sent_max=sent, result_density=int(st.result_nnz) / size if st is not None else None,
            predicted=predicted, page_faults=comm.allreduce(faults[name], op=MPI.MAX) / (reps * cell["calls_per_sample"]),
            **{f"model_{field}": value for field, value in dataclasses.asdict(model).items()},
        ))
    for row in rows:  # auto against the best fixed algorithm on its transport, timed from the same input
        fixed = [r["median"] for r in rows if r["transport"] == row["transport"] and r["algorithm"] in ALGORITHMS
                 and r["timed_from"] == row["timed_from"]]
        row["auto_over_best_fixed"] = row["median"] / min(fixed) if row["algorithm"] == "auto" and fixed else None
    return rows


def _progress_bar(done: int, total: int, label: str) -> None:
    width = 30
    filled = width * done // max(total, 1)
    print(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label:40s}", end="" if done < total else "\n",
          file=sys.stderr, flush=True)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mpirun -n P python -m sparcml_jax.bench allreduce", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", default="issue", choices=["quick", "issue", "full", "global-topk"],
                        help="which cells to measure (see scenarios()); --sizes/--densities/--supports override")
    parser.add_argument("--sizes", type=int, nargs="+")
    parser.add_argument("--densities", type=float, nargs="+")
    parser.add_argument("--supports", nargs="+", choices=SUPPORTS,
                        help="default with --sizes/--densities: topk for --sweep global-topk, else uniform")
    parser.add_argument("--algorithms", nargs="+", choices=[*ALGORITHMS, "auto"],
                        help=f"SparCML's algorithms; default: all and auto, for --sweep global-topk "
                             f"{' '.join(SPARCML_BESIDE_GLOBAL_TOPK)}")
    parser.add_argument("--global-topk", nargs="*", choices=GLOBAL_TOPK_ALGORITHMS, metavar="ALGORITHM",
                        help="global top-k allreduces of each rank's dense vector, "
                             f"{{{','.join(GLOBAL_TOPK_ALGORITHMS)}}}; default: all for --sweep global-topk, else none")
    parser.add_argument("--transports", nargs="+", default=["native", "mpi4jax"])
    parser.add_argument("--bits", type=int, nargs="+", default=[], choices=QUANTIZE_BITS,
                        help="also run DSAR and auto (of --algorithms) with QSGD at these bits, in both phases "
                             "wherever they carry dense values (rows 'dsar_split_allgather/q4', 'auto/q4')")
    parser.add_argument("--bfloat16", action="store_true",
                        help="also run every algorithm with bfloat16 values on the wire (rows 'dense/bf16', ...)")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--calls-per-sample", type=int, default=1, metavar="R",
                        help="time R calls in one jitted program (as inside a training step; JAX dispatches it "
                             "once) and report the time per call; 1 (default): one jitted program per call")
    parser.add_argument("--no-baselines", action="store_true", help="skip the mpi4py and allgather baselines")
    parser.add_argument("--quick", action="store_true", help="the quick sweep with 3 repetitions (a smoke run)")
    parser.add_argument("--json", help="write the rows to this JSON file (rank 0)")
    parser.add_argument("--csv", help="write the rows to this CSV file (rank 0)")
    parser.add_argument("--network", default="local", help="label of the network in the rows (e.g. 1gbit)")
    parser.add_argument("--inline-dispatch", action="store_true",
                        help="run every program on the calling thread (jax_cpu_enable_async_dispatch=False): XLA "
                             "then takes temp blocks over 64 MB from the main heap instead of mapping them afresh "
                             "every call")
    parser.add_argument("--cost-model", metavar="FILE",
                        help="the cost model for auto and the predictions (written by `bench calibrate`); "
                             "default: SPARCML_JAX_COST_MODEL, else measured")
    return parser


def _report(args, rows: list[dict], model, comm) -> None:
    """Rank 0 prints the table and writes the files."""
    if comm.Get_rank() != 0:
        return
    print(f"P={comm.Get_size()}  cost model: alpha={model.alpha * 1e6:.1f} us  "
          f"beta={model.beta * 1e9:.3f} ns/B ({1 / max(model.beta, 1e-30) / 1e9:.2f} GB/s)  "
          f"dense allreduce={model.dense_beta * 1e9:.3f} ns/B  merge={model.pair_cost * 1e9:.2f} ns/pair  "
          f"pass={model.element_cost * 1e9:.3f} ns/element")
    print_table(
        ["N", "density", "support", "algorithm", "transport", "from", "chosen", "median", "min", "max", "vs dense",
         "auto/best", "MB sent/rank", "result density", "model"],
        [[f"2^{int(math.log2(r['N']))}", f"{r['density']:.2%}", r["support"], r["algorithm"], r["transport"],
          r["timed_from"], r["chosen"] or "", fmt_time(r["median"]), fmt_time(r["min"]), fmt_time(r["max"]),
          f"{r['ratio_to_dense']:.3f}", "" if r["auto_over_best_fixed"] is None else f"{r['auto_over_best_fixed']:.2f}",
          "" if r["bytes_sent_max"] is None else f"{r['bytes_sent_max'] / 1e6:.3f}",
          "" if r["result_density"] is None else f"{r['result_density']:.2%}",
          "" if r["predicted"] is None else fmt_time(r["predicted"])] for r in rows],
    )
    print("vs dense = median time / median time of the dense mpi4jax allreduce in the same run (lower is better); "
          "auto/best = auto's median over the best fixed algorithm's on its transport")
    if any(r["timed_from"] == "x" and r["algorithm"] in (*ALGORITHMS, "auto") for r in rows):
        print("from x: timed from this rank's dense vector x, SparCML's rows including the local selection "
              "topk(x, k); from stream: the collective alone, handed topk(x, k)")
    if args.calls_per_sample > 1:
        print(f"times are per call, {args.calls_per_sample} calls per jitted program (dispatched once, as in a "
              "training step)")
    stolen = {(r["N"], r["density"], r["support"]): r["steal_seconds"] for r in rows if r["steal_seconds"]}
    for (size, density, support), seconds in stolen.items():
        print(f"the hypervisor took {seconds:.2f} s of CPU from this machine during cell "
              f"N=2^{int(math.log2(size))} {density:.2%} {support}")
    for row in rows:
        row["network"] = args.network
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.inline_dispatch:  # before the first computation creates the CPU client
        jax.config.update("jax_cpu_enable_async_dispatch", False)
    if args.quick:
        args.sweep, args.reps = "quick", 3
    cells = scenarios(args.sweep)
    global_sweep = args.sweep == "global-topk"
    if args.sizes or args.densities or args.supports:
        cells = [(n, d, sup) for n in (args.sizes or [1 << 22]) for d in (args.densities or [0.001, 0.01, 0.1])
                 for sup in (args.supports or ["topk" if global_sweep else "uniform"])]
    if args.algorithms is None:
        args.algorithms = list(SPARCML_BESIDE_GLOBAL_TOPK if global_sweep else (*ALGORITHMS, "auto"))
    if args.global_topk is None:
        args.global_topk = list(GLOBAL_TOPK_ALGORITHMS if global_sweep else ())
    comm = resolve_comm(None)
    if args.calls_per_sample < 1:
        parser.error(f"--calls-per-sample must be at least 1, got {args.calls_per_sample}")
    model = CostModel.load(args.cost_model) if args.cost_model else None
    rows, model = run(cells, args.algorithms, args.transports, args.reps, comm, baselines=not args.no_baselines,
                      calls_per_sample=args.calls_per_sample, model=model, global_topk=args.global_topk, bits=args.bits,
                      bfloat16=args.bfloat16,
                      progress=_progress_bar if comm.Get_rank() == 0 else None)
    _report(args, rows, model, comm)
    return rows
