"""Helpers of the mesh tests (tests/mesh) and the multi-process ones (tests/distributed): run a
function on the devices of a mesh axis, one input row per device, and read every device's result."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import sparcml_jax as sj

AXIS = "data"
# (size, capacity, density of the last device, support): unequal counts (device d has d + 1 / P of
# the density), every device empty, dense inputs that fill in, a size that no P divides, and the
# same support on every device.
CASES = ((1001, 300, 0.2, "random"), (64, 8, 0.0, "random"), (257, 257, 1.0, "random"), (300, 120, 0.3, "identical"))
# Latency-bound: auto picks by the number of rounds more than by the bytes.
MODEL = sj.CostModel(alpha=2e-5, beta=1e-9)


def on_mesh(p: int, fn, *per_device: np.ndarray, shared: tuple = ()):
    """``fn(*rows, *shared)`` on each of the first ``p`` devices (row d of every ``per_device``
    array on device d), its results stacked by device, as numpy arrays on every process (the mesh
    may span processes started with ``jax.distributed``)."""
    mesh = jax.make_mesh((p,), (AXIS,), devices=jax.devices()[:p])

    def body(*args):
        rows, rest = [a[0] for a in args[:len(per_device)]], args[len(per_device):]
        return jax.tree.map(lambda a: jnp.asarray(a)[None], fn(*rows, *rest))

    run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(AXIS),) * len(per_device) + (P(),) * len(shared),
                                out_specs=P(AXIS)))
    sharding = NamedSharding(mesh, P(AXIS))
    placed = [jax.make_array_from_callback(np.shape(a), sharding, lambda index, a=np.asarray(a): a[index])
              for a in per_device]
    out = run(*placed, *shared)
    return jax.tree.map(lambda a: np.asarray(a) if a.is_fully_addressable
                        else np.asarray(multihost_utils.process_allgather(a, tiled=True)), out)


def integer_rows(p: int, n: int, density: float, seed: int, support: str = "random") -> np.ndarray:
    """Small integers, device d keeping about ``density (d + 1) / p`` of them (unequal counts);
    with ``support="identical"`` every device keeps the same entries, ``density`` of them."""
    rng = np.random.default_rng([seed, p, n])
    rows = rng.integers(-9, 10, (p, n)).astype(np.float32)
    if support == "identical":
        rows[:, rng.random(n) >= density] = 0.0
        return rows
    for d in range(p):
        rows[d, rng.random(n) >= density * (d + 1) / p] = 0.0
    return rows


def accumulators(p: int, n: int, seed: int) -> np.ndarray:
    """Every device's dense accumulator for the global top-k algorithms: signed integers, 30 % zero."""
    rng = np.random.default_rng([seed, p, n])
    x = (rng.integers(1, 20, (p, n)) * rng.choice([-1, 1], (p, n))).astype(np.float32)
    x[:, rng.random(n) < 0.3] = 0.0
    return x


def identical_on_every_device(stacked) -> bool:
    return all(np.array_equal(leaf, np.broadcast_to(leaf[:1], leaf.shape)) for leaf in jax.tree.leaves(stacked))
