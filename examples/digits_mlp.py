"""A neural network trained with top-k 1 % + error feedback + 4-bit QSGD (SparCML §6, §8).

An MLP on scikit-learn's bundled digits: every step each rank sends its 1 % largest
(gradient + residual) entries; the sum travels through DSAR_Split_allgather with 4-bit QSGD on
its dense allgather phase. The same model is trained with a dense MPI_Allreduce beside it.

    mpirun -n 4 python examples/digits_mlp.py

With ``--algorithm spardl``, ``oktopk`` or ``gtopk`` the sum is a global top-k allreduce instead
(SparDL, Ok-Topk, gTop-k): its result keeps about 1 % of the entries whatever the number of
ranks, and what it drops returns to the ranks' residuals (no QSGD).

    mpirun -n 4 python examples/digits_mlp.py --algorithm spardl

``--unordered`` passes ``ordered=False`` (SparCML's algorithms): the sparse step's one collective
carries no JAX effect, and the step keeps JAX's C++ dispatch path.
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
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import sparcml_jax


def init_mlp(key, sizes):
    params = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        key, sub = jax.random.split(key)
        params.append({"w": jax.random.normal(sub, (fan_in, fan_out)) * jnp.sqrt(2.0 / fan_in),
                       "b": jnp.zeros(fan_out)})
    return params


def forward(params, x):
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def loss_fn(params, x, y):
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(forward(params, x), y))


def make_step(tx, compiler_options=None):
    """The jitted train step: the gradient, ``tx``'s update (the reducer first), the new parameters."""

    @functools.partial(jax.jit, donate_argnums=(0, 1), compiler_options=compiler_options)
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def load_data():
    """(x_train, y_train, x_test, y_test): scikit-learn's digits, 20 % held out."""
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(x, digits.target, test_size=0.2, random_state=0,
                                                        stratify=digits.target)
    return x_train, y_train.astype(np.int32), jnp.asarray(x_test), jnp.asarray(y_test)


def qsgd_bits(algorithm, bits):
    """The QSGD bits the reducer takes: only with auto or DSAR, whose dense phase they code."""
    return bits if bits and algorithm in ("auto", "dsar_split_allgather") else None


def train(name, reducer, data, args, comm, compiler_options=None):
    rank, nprocs = comm.Get_rank(), comm.Get_size()
    x_train, y_train, x_test, y_test = data
    per_rank = len(x_train) // nprocs
    x_mine, y_mine = x_train[rank * per_rank:(rank + 1) * per_rank], y_train[rank * per_rank:(rank + 1) * per_rank]
    params = init_mlp(jax.random.key(args.seed), [64, args.hidden, args.hidden, 10])
    tx = optax.chain(reducer, optax.adam(args.lr))
    opt_state = tx.init(params)
    step = make_step(tx, compiler_options)
    accuracy = jax.jit(lambda p: jnp.mean(jnp.argmax(forward(p, x_test), -1) == y_test))
    rng = np.random.default_rng(args.seed + rank)
    steps = per_rank // args.batch
    times, history = [], {"epoch": [], "loss": [], "accuracy": [], "time_s": []}
    for epoch in range(args.epochs):
        order = rng.permutation(per_rank)
        losses = []
        for s in range(steps):
            batch = order[s * args.batch:(s + 1) * args.batch]
            start = time.perf_counter()
            params, opt_state, loss = step(params, opt_state, x_mine[batch], y_mine[batch])
            loss.block_until_ready()
            times.append(time.perf_counter() - start)
            losses.append(float(loss))
        if (epoch + 1) % args.report_every == 0 or epoch + 1 == args.epochs:
            mean_loss = comm.allreduce(float(np.mean(losses)), op=MPI.SUM) / nprocs
            acc = float(accuracy(params))
            for field, value in (("epoch", epoch + 1), ("loss", mean_loss), ("accuracy", acc),
                                 ("time_s", comm.allreduce(sum(times), op=MPI.MAX))):
                history[field].append(value)
            if rank == 0:
                print(f"[{name:6s}] epoch {epoch + 1:3d}/{args.epochs}  loss {mean_loss:.4f}  test accuracy {acc:.4f}",
                      flush=True)
    step_ms = comm.allreduce(statistics.median(times[5:]) * 1e3, op=MPI.MAX)
    flat = np.concatenate([np.asarray(leaf).ravel() for leaf in jax.tree.leaves(params)])
    if not comm.allreduce(np.array_equal(flat, comm.bcast(flat, root=0)), op=MPI.LAND):
        raise RuntimeError(f"[{name}] the ranks' parameters differ after training")
    return {"accuracy": float(accuracy(params)), "step_ms": step_ms, "state": opt_state, "history": history}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--batch", type=int, default=16, help="samples per rank per step")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--density", type=lambda v: None if v == "none" else float(v), default=0.01,
                        help="fraction of the entries each rank sends, or 'none': every entry, exactly "
                             "(with --bits 0, the cost of the sparse path on a dense gradient)")
    parser.add_argument("--algorithm", default="dsar_split_allgather",
                        choices=[*sparcml_jax.ALGORITHMS, "auto", *sparcml_jax.GLOBAL_TOPK_ALGORITHMS],
                        help="SparCML's sparse allreduce, or a global top-k one (spardl, oktopk, gtopk)")
    parser.add_argument("--bits", type=int, default=4, help="QSGD bits on DSAR's dense phases (0: none)")
    parser.add_argument("--scale", default="max", choices=["max", "l2"])
    parser.add_argument("--quantize-feedback", action="store_true",
                        help="with --density none: feed what QSGD's split phase loses back into the next "
                             "gradient (error feedback for the quantization of a dense gradient)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--report-every", type=int, default=10)
    parser.add_argument("--buckets", type=int, default=0,
                        help="also train with the gradient split into this many buckets reduced by the "
                             "non-blocking engine (overlap), and compare step times")
    parser.add_argument("--unordered", action="store_true",
                        help="allreduce_gradients(ordered=False): the sparse step keeps JAX's C++ dispatch path")
    args = parser.parse_args(argv)

    comm = MPI.COMM_WORLD
    data = load_data()
    global_topk = args.algorithm in sparcml_jax.GLOBAL_TOPK_ALGORITHMS
    bits = qsgd_bits(args.algorithm, args.bits)
    if args.buckets and global_topk:
        parser.error(f"--buckets runs SparCML's algorithms on the non-blocking engine, not {args.algorithm}")
    if args.quantize_feedback and (bits is None or args.density is not None):
        parser.error("--quantize-feedback feeds back the quantization of a dense gradient: it needs --density none "
                     "and --bits with --algorithm auto or dsar_split_allgather")
    compression = dict(density=args.density, algorithm=args.algorithm, min_size=0, seed=args.seed,
                       **({} if bits is None else dict(quantize_bits=bits, quantize_scale=args.scale,
                                                       quantize_feedback=args.quantize_feedback)))
    if args.unordered and (global_topk or args.quantize_feedback):
        parser.error("--unordered runs SparCML's algorithms without --quantize-feedback")
    sparse = train("sparse", sparcml_jax.allreduce_gradients(**compression, ordered=not args.unordered), data, args,
                   comm)
    if args.buckets:
        bucketed_reducer = sparcml_jax.allreduce_gradients(**compression, buckets=args.buckets)
        # Lets each bucket's reduction start during the backward pass (see OVERLAP_COMPILER_OPTIONS).
        bucketed = train("bucket", bucketed_reducer, data, args, comm, sparcml_jax.OVERLAP_COMPILER_OPTIONS)
    dense = train("dense", sparcml_jax.dense_allreduce_gradients(), data, args, comm)
    if comm.Get_rank() == 0:
        stats = optax.tree_utils.tree_get(sparse["state"], "stats")
        names = (*sparcml_jax.ALGORITHMS, *sparcml_jax.GLOBAL_TOPK_ALGORITHMS)
        chosen = names[int(stats.algorithm)] if int(stats.algorithm) >= 0 else "dense"
        quantized = bits and chosen == "dsar_split_allgather"  # QSGD codes DSAR's dense phases only
        method = ("every entry" if args.density is None else f"top-k {args.density:.0%} + error feedback") + (
            f" + {bits}-bit QSGD" if quantized else "") + (" with error feedback" if args.quantize_feedback else "")
        through = args.algorithm if chosen == args.algorithm else f"{args.algorithm} ({chosen})"
        print(f"final: test accuracy sparse {sparse['accuracy']:.4f} vs dense {dense['accuracy']:.4f} "
              f"(gap {100 * (dense['accuracy'] - sparse['accuracy']):+.2f} points); "
              f"{method} through {through} sends {float(stats.bytes_sent) / 1e3:.1f} kB/step/rank "
              f"(result density {float(stats.density):.2%}); step {sparse['step_ms']:.2f} ms vs "
              f"{dense['step_ms']:.2f} ms", flush=True)
        if args.buckets:
            print(f"buckets: {args.buckets} buckets on the non-blocking engine: test accuracy "
                  f"{bucketed['accuracy']:.4f}; step {bucketed['step_ms']:.2f} ms vs {sparse['step_ms']:.2f} ms "
                  f"unbucketed ({bucketed['step_ms'] / sparse['step_ms']:.2f}x)", flush=True)
    return {"sparse": sparse, "dense": dense, **({"bucketed": bucketed} if args.buckets else {})}


if __name__ == "__main__":
    main()
