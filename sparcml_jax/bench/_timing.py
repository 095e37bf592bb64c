"""Timing helpers shared by the benchmarks: medians over repetitions, never a single sample."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import jax


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
