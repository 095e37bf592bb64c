"""A Flax CNN trained data-parallel with a global top-k allreduce (SparDL, Ok-Topk, gTop-k).

A small convolutional network (``flax.linen``) on scikit-learn's bundled 8x8 digits. Every rank
trains on its shard; one jitted step computes the gradient, sums it across the ranks with
``sparcml_jax.allreduce_gradients(density=0.01, algorithm=...)`` and applies Adam. The global
top-k allreduce keeps 1 % of the fused gradient in its result whatever the number of ranks, and
returns what it drops to the ranks' residuals (error feedback). Leaves below ``--min-size``
entries (biases, the first convolution, the last layer) travel whole: in a dense allreduce of
their own beside a global top-k, inside the fused buffer's collective with SparCML's algorithms
(``--algorithms auto``). The same model trained
with a dense MPI_Allreduce runs beside it, and after every epoch each run checks that every rank
holds the same parameters.

    mpirun -n 4 python examples/flax_digits_cnn.py                          # every global top-k
    mpirun -n 4 python examples/flax_digits_cnn.py --algorithms dsar_split_allgather spardl

With SparCML's algorithms, ``--unordered`` passes ``ordered=False``: the step's one collective
carries no JAX effect, and the step keeps JAX's C++ dispatch path.

    mpirun -n 4 python examples/flax_digits_cnn.py --algorithms auto --unordered

Low precision: bfloat16 parameters and gradients, the whole gradient with bfloat16 values on the
wire, or 4-bit QSGD on its dense phases:

    mpirun -n 4 python examples/flax_digits_cnn.py --dtype bfloat16 --density none --algorithms auto \\
        --value-dtype bfloat16
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from mpi4py import MPI
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import sparcml_jax


class CNN(nn.Module):
    """Two 3x3 convolutions, a 2x2 average pool and two dense layers: about 38 k parameters, in
    ``dtype`` (parameters, activations and so gradients)."""

    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        layer = dict(dtype=self.dtype, param_dtype=self.dtype)
        x = nn.relu(nn.Conv(16, (3, 3), **layer)(x.astype(self.dtype)))
        x = nn.relu(nn.Conv(32, (3, 3), **layer)(x))
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        x = nn.relu(nn.Dense(64, **layer)(x.reshape(x.shape[0], -1)))
        return nn.Dense(10, **layer)(x).astype(jnp.float32)


def load(seed: int):
    """Digits as float32 images in [0, 1] of shape (8, 8, 1), split 80 / 20 stratified."""
    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[..., None]
    x_train, x_test, y_train, y_test = train_test_split(x, digits.target.astype(np.int32), test_size=0.2,
                                                        random_state=seed, stratify=digits.target)
    return x_train, y_train, jnp.asarray(x_test), jnp.asarray(y_test)


def same_on_every_rank(params, comm: MPI.Comm) -> bool:
    flat = np.concatenate([np.asarray(leaf).ravel() for leaf in jax.tree.leaves(params)])
    return comm.allreduce(np.array_equal(flat, comm.bcast(flat, root=0)), op=MPI.LAND)


def make_step(tx: optax.GradientTransformation, model: CNN):
    """The jitted train step: the gradient, ``tx``'s update (the reducer first), the new parameters."""

    def loss_fn(p, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(model.apply({"params": p}, x), y).mean()

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(p, s, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(p, x, y)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    return step


def train(name: str, reducer: optax.GradientTransformation, data, args, comm: MPI.Comm) -> dict:
    rank, nprocs = comm.Get_rank(), comm.Get_size()
    x_train, y_train, x_test, y_test = data
    per_rank = len(x_train) // nprocs
    x_mine, y_mine = x_train[rank * per_rank:(rank + 1) * per_rank], y_train[rank * per_rank:(rank + 1) * per_rank]
    model = CNN(jnp.dtype(args.dtype))
    params = model.init(jax.random.key(args.seed), x_test[:1])["params"]  # the same on every rank
    tx = optax.chain(reducer, optax.adam(args.lr))
    opt_state = tx.init(params)
    step = make_step(tx, model)
    accuracy = jax.jit(lambda p: jnp.mean(jnp.argmax(model.apply({"params": p}, x_test), -1) == y_test))
    rng = np.random.default_rng(args.seed + rank)
    steps, times = per_rank // args.batch, []
    for epoch in range(args.epochs):
        order, losses = rng.permutation(per_rank), []
        for s in range(steps):
            batch = order[s * args.batch:(s + 1) * args.batch]
            start = time.perf_counter()
            params, opt_state, loss = step(params, opt_state, x_mine[batch], y_mine[batch])
            loss.block_until_ready()
            times.append(time.perf_counter() - start)
            losses.append(float(loss))
        if not same_on_every_rank(params, comm):
            raise RuntimeError(f"[{name}] epoch {epoch + 1}: the ranks' parameters differ")
        mean_loss = comm.allreduce(float(np.mean(losses)), op=MPI.SUM) / nprocs
        if rank == 0 and ((epoch + 1) % args.report_every == 0 or epoch + 1 == args.epochs):
            print(f"[{name:>20s}] epoch {epoch + 1:3d}/{args.epochs}  loss {mean_loss:.4f}  "
                  f"test accuracy {float(accuracy(params)):.4f}", flush=True)
    step_ms = comm.allreduce(statistics.median(times[min(5, len(times) - 1):]) * 1e3, op=MPI.MAX)
    return {"accuracy": float(accuracy(params)), "loss": mean_loss, "step_ms": step_ms, "state": opt_state}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algorithms", nargs="+", default=list(sparcml_jax.GLOBAL_TOPK_ALGORITHMS),
                        choices=[*sparcml_jax.GLOBAL_TOPK_ALGORITHMS, *sparcml_jax.ALGORITHMS, "auto"],
                        help="allreduce_gradients(algorithm=...) runs, each beside the dense baseline")
    parser.add_argument("--density", type=lambda v: None if v == "none" else float(v), default=0.01,
                        help="top-k fraction each rank sends, or 'none': the whole gradient (with SparCML's "
                             "algorithms)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="of the parameters and gradients")
    parser.add_argument("--value-dtype", default=None, choices=["bfloat16"],
                        help="values on the wire as bfloat16 (SparCML's algorithms)")
    parser.add_argument("--bits", type=int, default=None, help="QSGD bits on the dense phases (auto or DSAR)")
    parser.add_argument("--quantize-feedback", action="store_true",
                        help="with --density none and --bits: error feedback of QSGD's split phase")
    parser.add_argument("--min-size", type=int, default=1024, help="smaller leaves travel dense")
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--batch", type=int, default=16, help="samples per rank per step")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--report-every", type=int, default=1)
    parser.add_argument("--unordered", action="store_true",
                        help="allreduce_gradients(ordered=False): the step keeps JAX's C++ dispatch path "
                             "(SparCML's algorithms only)")
    args = parser.parse_args(argv)
    if args.unordered and (set(args.algorithms) & set(sparcml_jax.GLOBAL_TOPK_ALGORITHMS) or args.quantize_feedback):
        parser.error("--unordered runs SparCML's algorithms (--algorithms auto, ...), not a global top-k, "
                     "without --quantize-feedback")
    comm = MPI.COMM_WORLD
    data = load(args.seed)

    runs = {"dense": train("dense", sparcml_jax.dense_allreduce_gradients(), data, args, comm)}
    low_precision = dict(quantize_bits=args.bits, quantize_feedback=args.quantize_feedback,
                         value_dtype=args.value_dtype and jnp.dtype(args.value_dtype))
    low_precision = {k: v for k, v in low_precision.items() if v}
    for algorithm in args.algorithms:
        reducer = sparcml_jax.allreduce_gradients(density=args.density, algorithm=algorithm, min_size=args.min_size,
                                                  ordered=not args.unordered, **low_precision)
        what = "every entry" if args.density is None else f"top-k {args.density:.0%}"
        runs[algorithm] = train(f"{what} {algorithm}", reducer, data, args, comm)
    if comm.Get_rank() == 0:
        dense = runs["dense"]
        wire = ", ".join(f"{k}={v}" for k, v in low_precision.items()) or "float32 values"
        print(f"\nP = {comm.Get_size()}, {args.epochs} epochs, batch {args.batch} per rank, {args.dtype} parameters, "
              f"{wire}; parameters identical on every rank after every epoch")
        print(f"{'run':>22s}  {'test acc':>8s}  {'gap (points)':>12s}  {'step (ms)':>9s}  {'vs dense':>8s}  "
              f"{'kB/step/rank':>12s}  {'result density':>14s}")
        for name, run in runs.items():
            stats = None if name == "dense" else optax.tree_utils.tree_get(run["state"], "stats")
            print(f"{name:>22s}  {run['accuracy']:8.4f}  {100 * (dense['accuracy'] - run['accuracy']):+12.2f}  "
                  f"{run['step_ms']:9.2f}  {run['step_ms'] / dense['step_ms']:7.2f}x  "
                  + ("           -               -" if stats is None else
                     f"{float(stats.bytes_sent) / 1e3:12.1f}  {float(stats.density):14.2%}"), flush=True)
    return runs


if __name__ == "__main__":
    main()
