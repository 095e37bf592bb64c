"""End-to-end benchmark (run under mpirun): the training examples, sparse beside dense.

Runs ``examples/url_logreg.py`` (exact sparse sums, the paper's URL experiment in miniature) and
``examples/digits_mlp.py`` (top-k + error feedback + QSGD, optionally bucketed on the non-blocking
engine) from a source checkout, and prints per run the median step time, the final quality, and
the training time until the epoch loss first reaches the target: the worst final loss of the
example's runs times (1 + --tolerance), a loss every run reaches.

``--breakdown`` shows instead where an example's sparse step spends its time (the digits MLP, or
the Flax CNN with ``--model flax_digits_cnn``), beside its dense step: the steps and their parts
timed as programs of their own, in alternating blocks in one process (medians, maximum over
ranks), and the MPI calls each step makes.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from mpi4py import MPI

import sparcml_jax
from sparcml_jax.comm import native
from sparcml_jax.bench._timing import block, print_table
from sparcml_jax.collectives import CostModel
from sparcml_jax.stream import can_switch_to_dense

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _example(name: str):
    path = EXAMPLES / f"{name}.py"
    if not path.exists():
        raise SystemExit(f"bench train runs the examples of a source checkout; {path} not found")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def time_to_target(losses: list[float], times: list[float], target: float) -> float | None:
    """Training seconds until the loss first reaches ``target`` (None if it never does)."""
    return next((t for loss, t in zip(losses, times) if loss <= target), None)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="mpirun -n P python -m sparcml_jax.bench train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--examples", nargs="+", default=["url_logreg", "digits_mlp"], choices=["url_logreg", "digits_mlp"])
    p.add_argument("--tolerance", type=float, default=0.05, help="target = worst final loss * (1 + tolerance)")
    p.add_argument("--buckets", type=int, default=2, help="digits: also run the bucketed transform (0: no)")
    p.add_argument("--quick", action="store_true", help="small data and few epochs (a smoke run)")
    p.add_argument("--breakdown", action="store_true",
                   help="where an example's sparse step's time goes, beside the dense step (instead of the runs)")
    p.add_argument("--model", default="digits_mlp", choices=["digits_mlp", "flax_digits_cnn"],
                   help="breakdown: the example whose step is taken apart")
    p.add_argument("--density", type=lambda v: None if v == "none" else float(v), default=0.01,
                   help="breakdown: top-k density of the sparse step, or 'none': the exact mode (every nonzero)")
    p.add_argument("--algorithm", default="dsar_split_allgather", choices=[*sparcml_jax.ALGORITHMS, "auto"],
                   help="breakdown: the sparse step's algorithm")
    p.add_argument("--bits", type=int, default=4, help="breakdown: QSGD bits with auto or DSAR (0: none)")
    p.add_argument("--json", help="write the rows to this JSON file (rank 0)")
    args = p.parse_args(argv)
    rank = MPI.COMM_WORLD.Get_rank()
    if args.breakdown:
        rows = breakdown(args, MPI.COMM_WORLD, steps=10 if args.quick else 40, blocks=3 if args.quick else 8)
        if rank == 0:
            print_table(["part", "ms per step", "of the dense step", "MPI calls per step", "messages per call"],
                        [[r["part"], f"{r['ms']:.3f}", f"{r['vs_dense']:.2f}", r["mpi_calls"] or "",
                          r["messages"] or ""] for r in rows])
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(rows, f, indent=1)
        return

    rows = []
    if "url_logreg" in args.examples:
        url = _example("url_logreg").main(["--samples", "20000", "--features", str(1 << 18), "--epochs", "2"]
                                          if args.quick else [])
        target = max(h["loss"][-1] for h in url.values()) * (1 + args.tolerance)
        for run, h in url.items():
            rows.append(dict(example="url_logreg", run=run, step_ms=h["step_ms"][-1], final_loss=h["loss"][-1],
                             quality=h["test_accuracy"], target_loss=target,
                             time_to_target_s=time_to_target(h["loss"], h["time_s"], target)))
    if "digits_mlp" in args.examples:
        digits = _example("digits_mlp").main((["--epochs", "4", "--report-every", "2"] if args.quick else [])
                                             + ["--buckets", str(args.buckets)])
        target = max(r["history"]["loss"][-1] for r in digits.values()) * (1 + args.tolerance)
        for run, r in digits.items():
            h = r["history"]
            rows.append(dict(example="digits_mlp", run=run, step_ms=r["step_ms"], final_loss=h["loss"][-1],
                             quality=r["accuracy"], target_loss=target,
                             time_to_target_s=time_to_target(h["loss"], h["time_s"], target)))
    if rank == 0:
        print_table(["example", "run", "step (ms)", "final loss", "test accuracy", "target loss", "time to target (s)"],
                    [[r["example"], r["run"], f"{r['step_ms']:.2f}", f"{r['final_loss']:.4f}", f"{r['quality']:.4f}",
                      f"{r['target_loss']:.4f}",
                      "not reached" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.2f}"]
                     for r in rows])
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)


# The custom calls that communicate: the native engine's run and start, and mpi4jax's ops.
_MPI_CALL = re.compile(r"custom_call @(sparcml_mpi_run|sparcml_engine_start|mpi_\w+_ffi)\b")


def mpi_calls(lowered_text: str) -> int:
    """MPI calls one run of a lowered program makes (the native engine's agreement and algorithm
    are one call)."""
    return len(_MPI_CALL.findall(lowered_text))


def _alternating(programs: dict, steps: int, blocks: int, comm: MPI.Comm) -> dict[str, float]:
    """Median seconds per call of each ``programs[name]()`` (a step that carries its own state),
    timed in alternating blocks of ``steps`` calls after one block of warm-up; maximum over ranks."""
    times = {name: [] for name in programs}
    for b in range(blocks + 1):
        for name, call in programs.items():
            for _ in range(steps):
                start = time.perf_counter()
                block(call())
                if b:
                    times[name].append(time.perf_counter() - start)
    return {name: comm.allreduce(statistics.median(t), op=MPI.MAX) for name, t in times.items()}


def _model(name: str):
    """(x, y, params, make_step, fusing) of an example, ``fusing`` its leaf grouping: the digits
    MLP's reducer fuses every leaf (``min_size=0``, as the example runs it), the Flax CNN's keeps
    the default ``min_size``."""
    if name == "digits_mlp":
        digits_mlp = _example(name)
        x, y, _, _ = digits_mlp.load_data()
        return x, y, digits_mlp.init_mlp(jax.random.key(0), [64, 256, 256, 10]), digits_mlp.make_step, dict(min_size=0)
    cnn = _example(name)
    x, y, x_test, _ = cnn.load(0)
    model = cnn.CNN()
    return x, y, model.init(jax.random.key(0), x_test[:1])["params"], lambda tx: cnn.make_step(tx, model), {}


def _scalar_state(count: int) -> optax.GradientTransformation:
    """Passes updates through with ``count`` scalar state leaves: as many leaves as the sparse
    transform's state, to price what each leaf of a step's state costs its dispatch (JAX takes
    its Python dispatch path for a program with MPI calls, which handles every argument and result
    one by one)."""
    return optax.GradientTransformation(lambda params: tuple(jnp.zeros((), jnp.float32) for _ in range(count)),
                                        lambda updates, state, params=None: (updates, tuple(x + 1 for x in state)))


def _one_float_allreduce(nprocs: int, ordered: bool = True) -> optax.GradientTransformation:
    """Passes updates through (times the mean of a one on every rank) after an allreduce of one
    float: what JAX adds to any step that makes an MPI call, without its data. The call's ordered
    effect takes JAX's Python dispatch path, which handles every argument and result one by one,
    and it waits for the slowest rank. ``ordered=False``: the engine's MPI_Allreduce, unordered
    (see :func:`sparcml_jax.allreduce_gradients`'s ``ordered``), which keeps JAX's C++ path."""

    def update_fn(updates, state, params=None):
        if ordered:
            one = sparcml_jax.dense_allreduce(jnp.ones(1, jnp.float32))[0] / nprocs
        else:
            with native.unordered_calls():
                one = sparcml_jax.nonzeros_allreduce(jnp.ones(1, jnp.float32), algorithm="dense", average=True)[0]
        return jax.tree.map(lambda u: u * one, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def breakdown(args, comm: MPI.Comm, *, steps: int, blocks: int) -> list[dict]:
    """An example's sparse step (``--model``; top-k ``--density`` + error feedback,
    ``--algorithm``, ``--bits`` QSGD; ``--density none``: the exact mode) taken apart: the model
    and optimizer alone, plus the selection and error feedback (the exact mode: the packing), plus
    the collective (the whole step); the model and optimizer with an allreduce of one float (what
    any step that communicates pays before its data); the collective, the dense step's allreduce
    and QSGD's coding alone; the dense step carrying as many scalar state leaves as the sparse
    transform's state; and with ``ordered=False`` (no JAX effect: JAX's C++ dispatch path) the
    sparse step, a dense step on the engine's MPI_Allreduce and the one-float floor."""
    rank, nprocs = comm.Get_rank(), comm.Get_size()
    x_all, y_all, initial, make_step, fusing = _model(args.model)
    rng = np.random.default_rng(rank)
    batches = [rng.integers(0, len(x_all), 16) for _ in range(64)]
    bits = _example("digits_mlp").qsgd_bits(args.algorithm, args.bits)
    compression = dict(density=args.density, algorithm=args.algorithm, **fusing,
                       **({} if bits is None else dict(quantize_bits=bits)))
    exact = args.density is None
    local = optax.chain(sparcml_jax.fuse_leaves(None if exact else sparcml_jax.error_feedback(
        sparcml_jax.sparsify(density=args.density)), **fusing), sparcml_jax.densify())
    sparse = sparcml_jax.allreduce_gradients(**compression)
    extra = len(jax.tree.leaves(sparse.init(initial)))
    carrying = f"dense step + {extra} scalar state {'leaf' if extra == 1 else 'leaves'}"
    reducers = {"dense step": sparcml_jax.dense_allreduce_gradients(),
                "sparse step": sparse,
                carrying: optax.chain(sparcml_jax.dense_allreduce_gradients(), _scalar_state(extra)),
                "model and optimizer only": optax.identity(),
                "+ packing" if exact else "+ selection and error feedback": local,
                "model and optimizer + an allreduce of one float": _one_float_allreduce(nprocs),
                "dense step, ordered=False (the engine's MPI_Allreduce)": sparcml_jax.allreduce_gradients(
                    algorithm="dense", ordered=False, **fusing),
                "sparse step, ordered=False": sparcml_jax.allreduce_gradients(**compression, ordered=False),
                "model and optimizer + an unordered allreduce of one float": _one_float_allreduce(nprocs, False)}
    programs, calls = {}, {}
    for name, reducer in reducers.items():
        tx = optax.chain(reducer, optax.adam(1e-3))
        step = make_step(tx)
        params = jax.tree.map(jnp.copy, initial)  # each step donates its own
        state = [params, tx.init(params), 0]
        calls[name] = mpi_calls(step.lower(params, state[1], x_all[:16], y_all[:16]).as_text())

        def run(step=step, state=state):
            b = batches[state[2] % len(batches)]
            state[0], state[1], loss = step(state[0], state[1], x_all[b], y_all[b])
            state[2] += 1
            return loss

        programs[name] = run
    size = sum(leaf.size for leaf in jax.tree.leaves(params))
    k = size if exact else max(1, round(args.density * size))
    key = jax.random.key(1)
    vector = jnp.asarray(np.random.default_rng(rank).standard_normal(size), jnp.float32)
    stream = vector if exact else sparcml_jax.topk(vector, k)
    reduce = sparcml_jax.nonzeros_allreduce if exact else sparcml_jax.sparse_allreduce
    collective = jax.jit(lambda s, key: reduce(s, algorithm=args.algorithm, quantize_bits=bits, key=key,
                                               return_stats=True))
    _, stats = collective(stream, key)
    algorithm = sparcml_jax.ALGORITHMS[int(stats.algorithm)]
    programs["the collective alone"] = lambda: collective(stream, key)[0]
    calls["the collective alone"] = mpi_calls(collective.lower(stream, key).as_text())
    dense_collective = jax.jit(sparcml_jax.dense_allreduce)  # what the dense step's one call costs
    programs["the dense collective alone"] = lambda: dense_collective(vector)
    calls["the dense collective alone"] = mpi_calls(dense_collective.lower(vector).as_text())
    if bits is not None and algorithm == "dsar_split_allgather":  # auto quantizes only DSAR's dense phase
        from sparcml_jax.kernels.qsgd import qsgd_dequantize, qsgd_quantize

        part = jnp.asarray(np.random.default_rng(rank).standard_normal(-(-size // nprocs)), jnp.float32)
        coding = jax.jit(lambda v, key: qsgd_dequantize(qsgd_quantize(v, key, bits=bits, bucket_size=1024)))
        programs[f"QSGD {bits}-bit coding of N / P alone"] = lambda: coding(part, key)
    seconds = _alternating(programs, steps, blocks, comm)
    messages = CostModel(alpha=0.0, beta=0.0).pricing(
        algorithm, size=size, nnz=k, nprocs=nprocs,
        quantize_bits=bits if algorithm == "dsar_split_allgather" else None).messages
    # The sparse algorithms agree inside their own messages; a choice made at run time (a capacity
    # that allows the dense form, the exact mode) agrees first, in a recursive doubling. The dense
    # allreduce's messages are MPICH's own (not counted).
    if algorithm == "dense":
        messages = None
    elif exact or (args.algorithm == "auto" and can_switch_to_dense(k, size, 1.0)):
        lower = 1 << (nprocs.bit_length() - 1)
        messages += lower.bit_length() - 1 + (2 if lower < nprocs else 0)
    rows = []
    for name, t in seconds.items():
        sparse_call = name in ("sparse step", "the collective alone")
        rows.append(dict(part=name if name != "the collective alone" else f"the collective alone ({algorithm})",
                         ms=t * 1e3, vs_dense=t / seconds["dense step"], mpi_calls=calls.get(name),
                         messages=messages if sparse_call and nprocs > 1 and messages is not None else None))
    return rows


if __name__ == "__main__":
    main()
