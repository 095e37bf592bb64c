"""Sparse logistic regression, the SparCML paper's URL experiment (§8.2) in miniature.

Every rank trains on its shard; each step's gradient is naturally sparse (only the features of
the batch are touched), so ``sparcml_jax.allreduce_gradients()`` sums it exactly while sending
only the nonzeros. The same model is trained a second time with a dense MPI_Allreduce of the
gradient, and the two runs are printed side by side.

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


def logistic_loss(params, ids, vals, labels):
    logits = jnp.sum(jnp.take(params["w"], ids, mode="fill", fill_value=0.0) * vals, axis=1) + params["b"]
    return jnp.mean(optax.sigmoid_binary_cross_entropy(logits, labels))


def accuracy(params, data: SparseDataset) -> float:
    logits = jnp.sum(jnp.take(params["w"], data.ids, mode="fill", fill_value=0.0) * data.vals, axis=1) + params["b"]
    return float(jnp.mean((logits > 0) == (data.labels > 0.5)))


def train(name: str, reducer: optax.GradientTransformation, train_set: SparseDataset, test_set: SparseDataset,
          args, comm: MPI.Comm) -> dict:
    rank = comm.Get_rank()
    params = {"w": jnp.zeros(train_set.num_features, jnp.float32), "b": jnp.zeros((), jnp.float32)}
    tx = optax.chain(reducer, optax.adagrad(args.lr))
    opt_state = tx.init(params)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, ids, vals, labels):
        loss, grads = jax.value_and_grad(logistic_loss)(params, ids, vals, labels)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

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
            stats = getattr(opt_state[0], "stats", None)
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
    # min_size=0 fuses the bias into the sparse buffer: one collective per step, not two.
    reducer = sparcml_jax.allreduce_gradients(capacity=capacity + 1, transport=args.transport, min_size=0)
    sparse = train("sparse", reducer,
                   train_set, test_set, args, comm)
    dense = train("dense", sparcml_jax.dense_allreduce_gradients(), train_set, test_set, args, comm)

    weight_gap = float(jnp.max(jnp.abs(sparse["params"]["w"] - dense["params"]["w"])))
    if rank == 0:
        s, d = sparse["step_ms"][-1], dense["step_ms"][-1]
        print(f"final: sparse step {s:.2f} ms vs dense {d:.2f} ms ({d / s:.1f}x faster); "
              f"loss {sparse['loss'][-1]:.6f} vs {dense['loss'][-1]:.6f} "
              f"(|diff| {abs(sparse['loss'][-1] - dense['loss'][-1]):.1e}, max |w diff| {weight_gap:.1e}); "
              f"test accuracy {sparse['test_accuracy']:.4f} vs {dense['test_accuracy']:.4f}", flush=True)
    return {"sparse": sparse, "dense": dense}


if __name__ == "__main__":
    main()
