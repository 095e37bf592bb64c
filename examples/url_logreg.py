"""Sparse logistic regression, the SparCML paper's URL experiment (§8.2) in miniature.

Every rank trains on its shard. A step touches only the features of its batch, so the gradient
is naturally sparse and its sum is exact. The model is trained three times, side by side:

* ``sparse``: the gradient is formed as a stream from the looked-up weights' gradient
  (``sparcml_jax.coalesce``), summed by ``sparcml_jax.allreduce_gradients()`` and applied on its
  support only (``sparcml_jax.lazy(optax.adagrad)``, ``sparcml_jax.apply_updates``): no pass over
  the 4M weights at all, as in SparCML's own training loop.
* ``1-line``: ``jax.grad``'s dense gradient, with ``allreduce_gradients()`` added to the optax
  chain and nothing else changed: sparse communication, dense computation.
* ``dense``: the same chain with a dense MPI_Allreduce of the gradient.

    mpirun -n 4 python examples/url_logreg.py                       # built-in URL-like data
    mpirun -n 4 python examples/url_logreg.py --data url_combined   # the real data set
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from mpi4py import MPI

import sparcml_jax
from sparcml_jax.datasets import SparseDataset, load_svmlight, synthetic_url


def logistic_loss_of_rows(rows, b, vals, labels):
    """Mean logistic loss given each sample's looked-up weights ``rows = w[ids]``."""
    return jnp.mean(optax.sigmoid_binary_cross_entropy(jnp.sum(rows * vals, axis=1) + b, labels))


def logistic_loss(params, ids, vals, labels):
    rows = jnp.take(params["w"], ids, mode="fill", fill_value=0.0)  # ids == num_features: padding
    return logistic_loss_of_rows(rows, params["b"], vals, labels)


def accuracy(params, data: SparseDataset) -> float:
    logits = jnp.sum(jnp.take(params["w"], data.ids, mode="fill", fill_value=0.0) * data.vals, axis=1) + params["b"]
    return float(jnp.mean((logits > 0) == (data.labels > 0.5)))


def dense_step(tx: optax.GradientTransformation):
    def step(params, opt_state, ids, vals, labels):
        loss, grads = jax.value_and_grad(logistic_loss)(params, ids, vals, labels)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def sparse_step(tx: optax.GradientTransformation):
    def step(params, opt_state, ids, vals, labels):
        rows = jnp.take(params["w"], ids, mode="fill", fill_value=0.0)
        loss, (rows_grad, b_grad) = jax.value_and_grad(logistic_loss_of_rows, argnums=(0, 1))(
            rows, params["b"], vals, labels)
        grads = {"w": sparcml_jax.coalesce(ids, rows_grad, size=params["w"].size), "b": b_grad}
        updates, opt_state = tx.update(grads, opt_state, params)
        return sparcml_jax.apply_updates(params, updates), opt_state, loss

    return step


def train(name: str, tx: optax.GradientTransformation, make_step, train_set: SparseDataset, test_set: SparseDataset,
          args, comm: MPI.Comm) -> dict:
    rank = comm.Get_rank()
    params = {"w": jnp.zeros(train_set.num_features, jnp.float32), "b": jnp.zeros((), jnp.float32)}
    opt_state = tx.init(params)
    step = jax.jit(make_step(tx), donate_argnums=(0, 1))

    batches = len(train_set) // args.batch
    history = {"step_ms": [], "loss": [], "time_s": []}
    elapsed = 0.0
    for epoch in range(args.epochs):
        losses, times = [], []
        for b in range(batches):
            sl = slice(b * args.batch, (b + 1) * args.batch)
            start = time.perf_counter()
            params, opt_state, loss = step(params, opt_state, train_set.ids[sl], train_set.vals[sl], train_set.labels[sl])
            loss.block_until_ready()
            times.append(time.perf_counter() - start)
            losses.append(float(loss))
        epoch_loss = comm.allreduce(float(np.mean(losses)), op=MPI.SUM) / comm.Get_size()
        step_ms = comm.allreduce(statistics.median(times[1:] if epoch == 0 else times) * 1e3, op=MPI.MAX)
        elapsed += comm.allreduce(sum(times), op=MPI.MAX)
        history["loss"].append(epoch_loss)
        history["step_ms"].append(step_ms)
        history["time_s"].append(elapsed)
        if rank == 0:
            extra = ""
            stats = optax.tree_utils.tree_get(opt_state, "stats")
            if stats is not None:
                extra = (f"  reduced density {float(stats.density):.3%}  sent {float(stats.bytes_sent) / 1e3:.0f} kB/step"
                         f"  algorithm {sparcml_jax.ALGORITHMS[int(stats.algorithm)] if int(stats.algorithm) >= 0 else 'dense'}")
            print(f"[{name:6s}] epoch {epoch + 1}/{args.epochs}  loss {epoch_loss:.5f}  step {step_ms:7.2f} ms{extra}",
                  flush=True)
    history["test_accuracy"] = accuracy(params, test_set)
    history["params"] = params
    return history


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", help="svmlight/libsvm file (default: the built-in URL-like set)")
    parser.add_argument("--samples", type=int, default=120_000, help="size of the built-in set")
    parser.add_argument("--features", type=int, default=1 << 22, help="features of the built-in set")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=256, help="samples per rank per step")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.2, help="adagrad learning rate")
    parser.add_argument("--transport", default="native", choices=["native", "mpi4jax"])
    parser.add_argument("--runs", nargs="+", default=["sparse", "1-line", "dense"], choices=["sparse", "1-line", "dense"])
    args = parser.parse_args(argv)

    comm = MPI.COMM_WORLD
    rank, nprocs = comm.Get_rank(), comm.Get_size()
    start = time.perf_counter()
    data = load_svmlight(args.data) if args.data else synthetic_url(args.samples, args.features, seed=args.seed)
    train_all, test_set = data.split(0.1)
    train_set = train_all.shard(rank, nprocs)
    if rank == 0:
        print(f"data: {len(data)} samples, {data.num_features} features, "
              f"{float((data.vals != 0).sum(1).mean()):.0f} active per sample ({time.perf_counter() - start:.1f} s); "
              f"{nprocs} ranks x {len(train_set)} training samples, batch {args.batch} per rank", flush=True)

    # A step's gradient touches at most batch * row width features: the exact stream's capacity.
    capacity = min(args.batch * data.ids.shape[1], data.num_features)
    lr = args.lr
    runs = {
        "sparse": (optax.chain(sparcml_jax.allreduce_gradients(transport=args.transport),
                               sparcml_jax.lazy(optax.adagrad(lr))), sparse_step),
        # min_size=0 fuses the bias into the sparse buffer: one collective per step, not two.
        "1-line": (optax.chain(sparcml_jax.allreduce_gradients(capacity=capacity + 1, transport=args.transport,
                                                               min_size=0), optax.adagrad(lr)), dense_step),
        "dense": (optax.chain(sparcml_jax.dense_allreduce_gradients(), optax.adagrad(lr)), dense_step),
    }
    histories = {name: train(name, tx, make_step, train_set, test_set, args, comm)
                 for name, (tx, make_step) in runs.items() if name in args.runs}
    if not {"sparse", "dense"} <= set(histories):
        return histories
    sparse, dense = histories["sparse"], histories["dense"]
    weight_gap = float(jnp.max(jnp.abs(sparse["params"]["w"] - dense["params"]["w"])))
    if rank == 0:
        s, d = sparse["step_ms"][-1], dense["step_ms"][-1]
        print(f"final: sparse step {s:.2f} ms vs dense {d:.2f} ms ({d / s:.1f}x faster); "
              f"loss {sparse['loss'][-1]:.6f} vs {dense['loss'][-1]:.6f} "
              f"(|diff| {abs(sparse['loss'][-1] - dense['loss'][-1]):.1e}, max |w diff| {weight_gap:.1e}); "
              f"test accuracy {sparse['test_accuracy']:.4f} vs {dense['test_accuracy']:.4f}", flush=True)
        if "1-line" in histories:
            one = histories["1-line"]
            print(f"       1-line (jax.grad's dense gradient, sparse allreduce): step {one['step_ms'][-1]:.2f} ms "
                  f"({d / one['step_ms'][-1]:.1f}x faster than dense), loss {one['loss'][-1]:.6f}", flush=True)
    return histories


if __name__ == "__main__":
    main()
