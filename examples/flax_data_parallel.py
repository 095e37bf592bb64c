"""Data-parallel training the JAX way, on a device mesh: one transform replaces ``jax.lax.pmean``.

A Flax MLP (85 k parameters) on scikit-learn's bundled digits, trained in a jitted
``jax.shard_map`` step over the mesh axis ``"data"``: every device takes its share of the batch.
The baseline averages the gradients with ``jax.lax.pmean``; the other run sends each device's
1 % largest (gradient + residual) entries over XLA's collectives, with 4-bit QSGD where the sum
travels DSAR's dense phase (``auto`` picked recursive doubling here, which stays exact pairs). The change is one line: the ``pmean`` of the step moves into the optimizer::

    # grads = jax.lax.pmean(grads, "data")                       <- the baseline's step
    tx = optax.chain(sparcml_jax.allreduce_gradients(density=0.01, quantize_bits=4, axis_name="data"),
                     optax.adam(1e-3))

``algorithm="auto"`` (the default) chooses with a cost model that it measures over the axis's
devices while the first step is traced. The optimizer state holds each device's own
residual, so it is sharded over the axis; the parameters stay replicated, and after every epoch
the run checks that every device holds the same ones.

    python examples/flax_data_parallel.py                 # 4 forced CPU devices
    python examples/flax_data_parallel.py --devices 8

The same script spans processes under ``jax.distributed`` (README, "On a mesh").
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=4, help="forced CPU devices (before JAX starts)")
    parser.add_argument("--distributed", action="store_true",
                        help="join a jax.distributed job first (under mpirun, or JAX's own cluster detection)")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch", type=int, default=16, help="samples per device per step")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--bits", type=int, default=4, help="QSGD bits on the dense phase (0: none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--report-every", type=int, default=5)
    args = parser.parse_args(argv)
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={args.devices}"

    import jax

    if args.distributed:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        under_mpirun = "PMI_SIZE" in os.environ or "OMPI_COMM_WORLD_SIZE" in os.environ
        jax.distributed.initialize(**({"cluster_detection_method": "mpi4py"} if under_mpirun else {}))
    return train_both(args)


def train_both(args) -> dict:
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    import sparcml_jax

    class MLP(nn.Module):
        hidden: int

        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Dense(self.hidden)(x))
            x = nn.relu(nn.Dense(self.hidden)(x))
            return nn.Dense(10)(x)

    devices = jax.device_count()
    mesh = jax.make_mesh((devices,), ("data",))
    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split((digits.data / 16.0).astype(np.float32),
                                                        digits.target.astype(np.int32), test_size=0.2,
                                                        random_state=0, stratify=digits.target)
    model = MLP(args.hidden)
    loss_fn = lambda p, x, y: optax.softmax_cross_entropy_with_integer_labels(  # noqa: E731
        model.apply({"params": p}, x), y).mean()
    accuracy = jax.jit(lambda p: jnp.mean(jnp.argmax(model.apply({"params": p}, x_test), -1) == y_test))
    per_device = NamedSharding(mesh, P("data"))
    stacked = lambda tree: jax.tree.map(lambda a: a[None], tree)  # noqa: E731
    unstacked = lambda tree: jax.tree.map(lambda a: a[0], tree)  # noqa: E731

    def train(name: str, tx: optax.GradientTransformation, pmean: bool) -> dict:
        def local_step(params, state, x, y):
            loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
            if pmean:
                grads = jax.lax.pmean(grads, "data")
            updates, state = tx.update(grads, unstacked(state), params)
            return optax.apply_updates(params, updates), stacked(state), jax.lax.pmean(loss, "data")

        # The updates are equal on every device but typed as varying over "data" (they come from
        # ppermute): check_vma=False lets them return replicated.
        step = jax.jit(jax.shard_map(local_step, mesh=mesh, in_specs=(P(), P("data"), P("data"), P("data")),
                                     out_specs=(P(), P("data"), P()), check_vma=False), donate_argnums=(0, 1))
        init = jax.jit(jax.shard_map(lambda p: stacked(tx.init(p)), mesh=mesh, in_specs=P(), out_specs=P("data"),
                                     check_vma=False))
        params = model.init(jax.random.key(args.seed), x_test[:1])["params"]
        state = init(params)
        rng = np.random.default_rng(args.seed)
        global_batch = args.batch * devices
        steps, times = len(x_train) // global_batch, []
        for epoch in range(args.epochs):
            order, losses = rng.permutation(len(x_train)), []
            for s in range(steps):
                batch = order[s * global_batch:(s + 1) * global_batch]
                x, y = (jax.make_array_from_callback(a.shape, per_device, lambda index, a=a: a[index])
                        for a in (x_train[batch], y_train[batch]))
                start = time.perf_counter()
                params, state, loss = step(params, state, x, y)
                loss.block_until_ready()
                times.append(time.perf_counter() - start)
                losses.append(float(loss))
            held = [np.concatenate([np.asarray(shard.data).ravel() for shard in
                                    (leaf.addressable_shards[d] for leaf in jax.tree.leaves(params))])
                    for d in range(jax.local_device_count())]
            agreed = all(np.array_equal(h, held[0]) for h in held) and bool(np.all(
                multihost_utils.process_allgather(held[0]) == held[0]))
            if not agreed:
                raise RuntimeError(f"[{name}] epoch {epoch + 1}: the devices' parameters differ")
            if jax.process_index() == 0 and ((epoch + 1) % args.report_every == 0 or epoch + 1 == args.epochs):
                print(f"[{name:>14s}] epoch {epoch + 1:3d}/{args.epochs}  loss {np.mean(losses):.4f}  test accuracy "
                      f"{float(accuracy(params)):.4f}  (parameters identical on all {devices} devices)", flush=True)
        stats = optax.tree_utils.tree_get(state, "stats")
        first_shard = lambda a: np.asarray(a.addressable_shards[0].data)[0]  # noqa: E731
        chosen = None if stats is None else int(first_shard(stats.algorithm))
        return {"accuracy": float(accuracy(params)), "step_ms": statistics.median(times[5:]) * 1e3,
                "kB_sent": None if stats is None else max(float(np.max(np.asarray(shard.data)))
                                                            for shard in stats.bytes_sent.addressable_shards) / 1e3,
                "algorithm": "pmean" if chosen is None else "dense" if chosen < 0
                else (sparcml_jax.ALGORITHMS + sparcml_jax.GLOBAL_TOPK_ALGORITHMS)[chosen]}

    adam = optax.adam(args.lr)
    runs = {"pmean": train("pmean", adam, pmean=True)}
    reducer = sparcml_jax.allreduce_gradients(density=args.density, quantize_bits=args.bits or None,
                                              axis_name="data", seed=args.seed)
    name = f"top-k {args.density:.0%}" + (f" {args.bits}-bit" if args.bits else "")
    runs[name] = train(name, optax.chain(reducer, adam), pmean=False)
    if jax.process_index() == 0:
        dense = runs["pmean"]
        print(f"\n{devices} devices in {jax.process_count()} process(es), {args.epochs} epochs, batch {args.batch} "
              "per device")
        print(f"{'run':>16s}  {'test acc':>8s}  {'gap (points)':>12s}  {'step (ms)':>9s}  {'vs pmean':>8s}  "
              f"{'kB/step/device':>14s}  algorithm")
        for run_name, run in runs.items():
            sent = "-" if run["kB_sent"] is None else f"{run['kB_sent']:.1f}"
            print(f"{run_name:>16s}  {run['accuracy']:8.4f}  {100 * (dense['accuracy'] - run['accuracy']):+12.2f}  "
                  f"{run['step_ms']:9.2f}  {run['step_ms'] / dense['step_ms']:7.2f}x  {sent:>14s}  {run['algorithm']}",
                  flush=True)
    return runs


if __name__ == "__main__":
    main(sys.argv[1:])
