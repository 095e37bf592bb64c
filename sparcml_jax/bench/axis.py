"""Allreduce benchmark over a mesh axis (the XLA transport): every SparCML algorithm,
``sparse_allreduce(stream, axis_name="data", algorithm=...)`` inside a jitted ``jax.shard_map``,
against ``jax.lax.psum`` of the dense vectors measured in the same run.

Run it on D forced CPU devices of one process, or across processes joined by ``jax.distributed``
(gloo on CPU; under mpirun the processes find each other through mpi4py, elsewhere through JAX's
own cluster detection, e.g. SLURM's, with ``JAX_COORDINATOR_ADDRESS`` if set)::

    python -m sparcml_jax.bench axis --devices 4
    mpirun -n 2 python -m sparcml_jax.bench axis --devices 2 --distributed   # 2 x 2 = 4 devices

Every device's input is its own stream (``allreduce.make_stream`` with rank = the device's index
on the axis, nprocs = D), placed as one array sharded over its leading device axis. Each case is
one jitted shard_map program, compiled and warmed up before any sample; then come ``--reps``
repetitions, the cases in a new shuffled order every repetition (the same on every process), each
call timed until its result is ready. Across processes each call starts after a barrier of all
devices and its sample is the maximum over processes of their times. Rows give the median, min
and max of the samples and the ratio of the median to psum's median. psum's input is every
device's dense vector ``s.to_dense()``, formed before the timed program, so its row times the
psum alone. ``auto`` chooses with a cost model (``--cost-model FILE`` or
``SPARCML_JAX_COST_MODEL``); without one it is measured over the axis first
(:meth:`~sparcml_jax.CostModel.calibrate_on_axis`). ``--global-topk`` adds the global top-k
allreduces (SparDL, gTop-k, Ok-Topk) of every device's dense vector with k = density N, timed
from that vector (their local selection included). ``--calls-per-sample R`` times R calls in one
jitted program, as in allreduce.py.

What forced CPU devices show: they share one process's memory and the machine's cores, so a
message between them is a memory copy and the devices' computations compete for the cores. The
ratios are the local cost (selection, merges, padding of the static buffers) of the algorithms
against XLA's psum, not what a network would make of their bytes (``MB sent/device``, the most
any device sent, is that).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from sparcml_jax.bench._timing import block, fmt_time, print_table, repeated_in_one_program
from sparcml_jax.bench.allreduce import SUPPORTS, _progress_bar, make_accumulator, make_stream
from sparcml_jax.collectives import ALGORITHMS, CostModel, sparse_allreduce
from sparcml_jax.collectives._plan import GLOBAL_TOPK_ALGORITHMS
from sparcml_jax.collectives.auto import COST_MODEL_ENV
from sparcml_jax.collectives.global_topk import global_topk_allreduce, init_oktopk_state
from sparcml_jax.kernels.topk import topk
from sparcml_jax.stream import SparseStream

AXIS = "data"
BASELINE = ("psum", "x")  # (algorithm, timed from)


def force_devices(count: int) -> None:
    """``count`` CPU devices in this process; must run before JAX's backend starts."""
    from sparcml_jax.comm._compat import backends_started

    if backends_started():
        raise RuntimeError("--devices: JAX's backend has already started in this process, too late to force devices")
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={count}"


def start_distributed() -> None:
    """Joins this process to the ``jax.distributed`` job, gloo between the processes' CPU clients."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # concerns the CPU client only
    if "PMI_SIZE" in os.environ or "OMPI_COMM_WORLD_SIZE" in os.environ:  # launched by mpirun
        jax.distributed.initialize(cluster_detection_method="mpi4py")
    else:  # JAX's own cluster detection (SLURM, Kubernetes, ...); JAX_COORDINATOR_ADDRESS if set
        jax.distributed.initialize()


def _placed(mesh, row_of, count: int):
    """The pytree ``row_of(d)`` (numpy leaves) of every device d, as arrays of ``count`` rows
    sharded over the axis; each process forms the rows of its own devices only."""
    sharding = NamedSharding(mesh, P(AXIS))
    cache: dict[int, list] = {}

    def leaves_of(d: int) -> list:
        if d not in cache:
            cache[d] = jax.tree.leaves(row_of(d))
        return cache[d]

    mine = next(d for d, device in enumerate(mesh.devices.flat) if device.process_index == jax.process_index())
    example = row_of(mine)
    cache[mine] = jax.tree.leaves(example)
    return jax.tree.unflatten(jax.tree.structure(example), [
        jax.make_array_from_callback((count, *np.shape(leaf)), sharding,
                                     lambda index, i=i: np.stack([leaves_of(d)[i] for d in range(count)[index[0]]]))
        for i, leaf in enumerate(leaves_of(mine))])


def _host(a: jax.Array) -> np.ndarray:
    """Every device's rows of ``a`` on every process."""
    return np.asarray(a) if a.is_fully_addressable else np.asarray(multihost_utils.process_allgather(a, tiled=True))


def _device_inputs(size: int, k: int, support: str, d: int, count: int) -> tuple[SparseStream, np.ndarray]:
    """Device d's stream and its dense vector (``"topk"``: the top k of its dense accumulator)."""
    if support != "topk":
        s = make_stream(size, k, support, d, count)
        return jax.tree.map(np.asarray, (s, s.to_dense()))
    x = make_accumulator(size, d)
    return jax.tree.map(np.asarray, (topk(x, k), x))


def _program(mesh, fn):
    """``fn(*rows) -> (result, stats or None)`` on every device, as one shard_map over the axis:
    ``program(clock, *stacked)`` returns ``(tag, (result, stats))``, every leaf with a leading
    device axis. ``clock`` is a tiny stream whose ``nnz`` :func:`repeated_in_one_program` feeds
    from its loop: an optimization barrier ties every input to it, so that no call of the loop
    (psum's neither) can be hoisted out of it, and ``tag`` (the loop's dependency) takes one
    entry of the result."""

    def body(clock, *stacked):
        rows = jax.tree.map(lambda a: a[0], stacked)
        rows, tick = jax.lax.optimization_barrier((rows, clock.nnz[0]))
        out = fn(*rows)
        first = next(leaf for leaf in jax.tree.leaves(out) if leaf.dtype == jnp.float32)
        tag = first.reshape(-1)[:1] + 0 * tick.astype(jnp.float32)
        return jax.tree.map(lambda a: jnp.asarray(a)[None], (tag, out))

    return jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS))


def _global_topk_case(algorithm: str, k: int, dense, clock, mesh, count: int):
    """A global top-k allreduce of every device's dense vector. Ok-Topk is timed on a step between
    its re-evaluations, as most of its steps run: from the state after one first step."""
    options = dict(algorithm=algorithm, axis_name=AXIS, return_stats=True)
    if algorithm != "oktopk":
        def call(x):
            total, residual, stats = global_topk_allreduce(x, k, **options)
            return (total, residual), stats

        return call, (dense,)

    def stepped(x, state):
        total, residual, next_state, stats = global_topk_allreduce(x, k, oktopk_state=state, **options)
        return (total, residual, next_state), stats

    first = _placed(mesh, lambda d: jax.tree.map(np.asarray, init_oktopk_state(nprocs=count)), count)
    _, ((_, _, state), _) = jax.jit(_program(mesh, stepped))(clock, dense, first)
    return stepped, (dense, state)


def _cases(streams, dense, k: int, algorithms, global_topk, model, clock, mesh, count: int) -> dict:
    """(algorithm, timed from) -> (the call on one device's rows, the stacked inputs)."""
    cases = {BASELINE: (lambda x: (jax.lax.psum(x, AXIS), None), (dense,))}
    for algorithm in algorithms:
        cases[(algorithm, "stream")] = (
            lambda s, a=algorithm: sparse_allreduce(s, axis_name=AXIS, algorithm=a, cost_model=model,
                                                    return_stats=True), (streams,))
    for algorithm in global_topk:
        cases[(algorithm, "x")] = _global_topk_case(algorithm, k, dense, clock, mesh, count)
    return cases


def _compiled(mesh, cases: dict, clock, calls: int) -> tuple[dict, dict]:
    """Compiles and warms up every case: (its stats, a timed call per case)."""
    stats, timed = {}, {}
    for name, (fn, inputs) in cases.items():
        call = _program(mesh, fn)
        single = jax.jit(call)
        stats[name] = block(single(clock, *inputs))[1][1]
        program = single if calls == 1 else repeated_in_one_program(call, calls)
        timed[name] = lambda program=program, inputs=inputs: program(clock, *inputs)
        block(timed[name]())
    return stats, timed


def _interleaved_samples(timed: dict, reps: int, calls: int) -> dict:
    """Per case its per-call times over ``reps`` repetitions in shuffled orders; across processes
    each sample is the maximum over processes."""
    samples = {name: [] for name in timed}
    processes = jax.process_count()
    for rep in range(reps):
        order = list(timed)
        np.random.default_rng(rep).shuffle(order)  # the same order on every process
        for name in order:
            if processes > 1:
                multihost_utils.sync_global_devices("sparcml_jax.bench.axis")
            start = time.perf_counter()
            block(timed[name]())
            samples[name].append((time.perf_counter() - start) / calls)
    if processes > 1:
        names = list(samples)
        slowest = np.asarray(multihost_utils.process_allgather(np.array([samples[n] for n in names]))).max(axis=0)
        samples = {name: [float(t) for t in slowest[i]] for i, name in enumerate(names)}
    return samples


def _cell_rows(cell: dict, samples: dict, stats: dict) -> list[dict]:
    """One row per case: times, the ratio to psum, bytes sent (max over devices), result density."""
    baseline = float(np.median(samples[BASELINE]))
    rows = []
    for (algorithm, timed_from), times in samples.items():
        st = stats[(algorithm, timed_from)]
        median = float(np.median(times))
        rows.append(dict(
            cell, algorithm=algorithm, timed_from=timed_from,
            chosen=ALGORITHMS[int(_host(st.algorithm)[0])] if algorithm == "auto" else None,
            median=median, min=float(np.min(times)), max=float(np.max(times)), ratio_to_psum=median / baseline,
            bytes_sent_max=None if st is None else float(_host(st.bytes_sent).max()),
            result_density=None if st is None else float(_host(st.result_nnz).max()) / cell["N"]))
    fixed = [r["median"] for r in rows if r["algorithm"] in ALGORITHMS]
    for row in rows:
        row["auto_over_best_fixed"] = row["median"] / min(fixed) if row["algorithm"] == "auto" and fixed else None
    return rows


def run(cells, algorithms, global_topk=(), reps: int = 7, calls_per_sample: int = 1, model: CostModel | None = None,
        progress=None) -> list[dict]:
    """The rows of every (N, density, support) cell over all devices there are (one mesh axis)."""
    count = jax.device_count()
    mesh = jax.make_mesh((count,), (AXIS,), axis_types=(AxisType.Auto,))
    if model is None and "auto" in algorithms:
        model = CostModel.calibrate_on_axis(mesh, AXIS)
    clock = _placed(mesh, lambda d: SparseStream(np.zeros(1, np.int32), np.zeros(1, np.float32), np.int32(0), 1),
                    count)
    rows = []
    for index, (size, density, support) in enumerate(cells):
        if progress:
            progress(index, len(cells), f"N=2^{int(math.log2(size))} density={density:.2%} {support}")
        k = max(1, int(round(size * density)))
        streams, dense = _placed(mesh, lambda d: _device_inputs(size, k, support, d, count), count)
        cases = _cases(streams, dense, k, algorithms, global_topk, model, clock, mesh, count)
        stats, timed = _compiled(mesh, cases, clock, calls_per_sample)
        samples = _interleaved_samples(timed, reps, calls_per_sample)
        cell = dict(N=size, density=density, support=support, D=count, processes=jax.process_count(),
                    calls_per_sample=calls_per_sample)
        rows += _cell_rows(cell, samples, stats)
    if progress:
        progress(len(cells), len(cells), "done")
    return rows


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m sparcml_jax.bench axis", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, metavar="D",
                        help="force D CPU devices in this process (per process with --distributed); "
                             "default: the devices there are")
    parser.add_argument("--distributed", action="store_true",
                        help="join a jax.distributed job first (under mpirun: found through mpi4py)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1 << 22])
    parser.add_argument("--densities", type=float, nargs="+", default=[0.001, 0.01, 0.1])
    parser.add_argument("--supports", nargs="+", choices=SUPPORTS, default=["uniform"])
    parser.add_argument("--algorithms", nargs="+", choices=[*ALGORITHMS, "auto"],
                        help="SparCML's algorithms; default: all and auto")
    parser.add_argument("--global-topk", nargs="*", choices=GLOBAL_TOPK_ALGORITHMS, metavar="ALGORITHM",
                        help="also the global top-k allreduces of every device's dense vector with k = density N, "
                             f"{{{','.join(GLOBAL_TOPK_ALGORITHMS)}}}; no names: all of them")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--calls-per-sample", type=int, default=1, metavar="R",
                        help="time R calls in one jitted program (as inside a training step; JAX dispatches it "
                             "once) and report the time per call; 1 (default): one jitted program per call")
    parser.add_argument("--cost-model", metavar="FILE",
                        help="the cost model auto chooses with (written by `bench calibrate --axis data`); "
                             "default: SPARCML_JAX_COST_MODEL, else measured over the axis first")
    parser.add_argument("--json", help="write the rows to this JSON file (process 0)")
    return parser


def _header(count: int, processes: int) -> str:
    line = f"D={count} devices on axis {AXIS!r}, {processes} process(es), {os.cpu_count()} cores."
    if jax.devices()[0].platform == "cpu":
        line += (" Forced CPU devices share their process's memory and the machine's cores: a message between "
                 "them is a memory copy, and the devices' computations compete for the cores. The ratios show the "
                 "algorithms' local cost (selection, merges, padding) against XLA's psum, not a network's.")
        if processes > 1:
            line += " Between processes messages go through gloo (TCP, on this machine: loopback)."
    return line


def _report(args, rows: list[dict], notes: list[str]) -> None:
    print(_header(rows[0]["D"], rows[0]["processes"]))
    for note in notes:
        print(note)
    print_table(
        ["N", "density", "support", "algorithm", "from", "chosen", "median", "min", "max", "vs psum", "auto/best",
         "MB sent/device", "result density", "D", "processes"],
        [[f"2^{int(math.log2(r['N']))}" if r["N"] & (r["N"] - 1) == 0 else r["N"], f"{r['density']:.2%}",
          r["support"], r["algorithm"], r["timed_from"], r["chosen"] or "", fmt_time(r["median"]),
          fmt_time(r["min"]), fmt_time(r["max"]), f"{r['ratio_to_psum']:.3f}",
          "" if r["auto_over_best_fixed"] is None else f"{r['auto_over_best_fixed']:.2f}",
          "" if r["bytes_sent_max"] is None else f"{r['bytes_sent_max'] / 1e6:.4f}",
          "" if r["result_density"] is None else f"{r['result_density']:.2%}", r["D"], r["processes"]]
         for r in rows])
    print(f"vs psum = median time / median time of jax.lax.psum of the dense vectors in the same run (lower is "
          f"better), medians over {args.reps} repetitions; from x: timed from every device's dense vector; "
          "from stream: the collective alone; MB sent/device: the most any device sent")
    if args.calls_per_sample > 1:
        print(f"times are per call, {args.calls_per_sample} calls per jitted program (dispatched once, as in a "
              "training step)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.calls_per_sample < 1:
        parser.error(f"--calls-per-sample must be at least 1, got {args.calls_per_sample}")
    if args.devices is not None:
        if args.devices < 1:
            parser.error(f"--devices must be at least 1, got {args.devices}")
        force_devices(args.devices)
    if args.distributed:
        start_distributed()
    algorithms = list(args.algorithms or [*ALGORITHMS, "auto"])
    global_topk = [] if args.global_topk is None else list(args.global_topk or GLOBAL_TOPK_ALGORITHMS)
    path = args.cost_model or os.environ.get(COST_MODEL_ENV)
    model = CostModel.load(path) if path else None
    notes = [] if model is not None or "auto" not in algorithms else [
        "auto chooses with a cost model calibrated over the axis before the first cell"]
    cells = [(n, d, s) for n in args.sizes for d in args.densities for s in args.supports]
    first = jax.process_index() == 0
    rows = run(cells, algorithms, global_topk, args.reps, args.calls_per_sample, model,
               progress=_progress_bar if first else None)
    if first:
        _report(args, rows, notes)
    return rows


if __name__ == "__main__":
    main()
