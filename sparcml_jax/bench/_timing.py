"""Timing helpers shared by the benchmarks: medians over repetitions, never a single sample."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

from sparcml_jax.stream import SparseStream


def block(x: Any) -> Any:
    return jax.tree.map(lambda a: a.block_until_ready() if hasattr(a, "block_until_ready") else a, x)


def samples_seconds(fn: Callable[[], Any], reps: int, warmup: int = 2) -> list[float]:
    """Wall times of ``fn()`` (its outputs blocked on) over ``reps`` runs after ``warmup``."""
    for _ in range(warmup):
        block(fn())
    out = []
    for _ in range(reps):
        start = time.perf_counter()
        block(fn())
        out.append(time.perf_counter() - start)
    return out


def median_seconds(fn: Callable[[], Any], reps: int, warmup: int = 2) -> float:
    return statistics.median(samples_seconds(fn, reps, warmup))


def fmt_time(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:8.1f} us"
    return f"{seconds * 1e3:8.2f} ms"


def print_table(headers: list[str], rows: list[list[Any]]) -> None:
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = "  ".join(h.rjust(w) for h, w in zip(headers, widths))
    print(line)
    print("-" * len(line))
    for r in cells:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))


def repeated_in_one_program(call: Callable[..., Any], calls: int) -> Callable[..., jax.Array]:
    """``calls`` calls of ``call`` in one jitted loop, as collectives run inside a training step
    (JAX dispatches the program once). Each call must depend on the one before, or XLA would
    hoist it out of the loop: the streams among the arguments take their ``nnz`` from the loop's
    carry, a scalar that stays 0. (Adding the carry to every value instead cost two passes per
    call: 70-100 us of the 240-330 us measured for a merge at N = 2^24, 1 %.)"""

    def feed(arg, carry):
        if isinstance(arg, SparseStream):
            return SparseStream(arg.indices, arg.values, jnp.minimum(arg.nnz, arg.nnz + carry.astype(jnp.int32)),
                                arg.size)
        return arg

    @jax.jit
    def run(*args):
        def body(i, carry):
            out = call(*(feed(a, carry) for a in args))
            first = next(leaf for leaf in jax.tree.leaves(out) if leaf.dtype == jnp.float32)
            return carry + 0 * first.reshape(-1)[0]

        return jax.lax.fori_loop(0, calls, body, jnp.float32(0))

    return run
