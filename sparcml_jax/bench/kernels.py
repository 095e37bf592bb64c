"""Kernel benchmark: each C kernel against the baseline a user would otherwise pay, same run.

* top-k selection vs ``jax.lax.top_k(|x|, k)``;
* merge-sum of two k-streams vs one memcpy of the same bytes (numpy ``copyto``);
* QSGD quantize / dequantize vs one memory pass over the float32 input (jitted ``max(|x|)``).

Merges run many times inside one jitted ``fori_loop`` so that dispatch cost (~20 us) does not
hide the kernel; times are medians over repetitions.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from sparcml_jax.bench._timing import fmt_time, median_seconds, print_table, repeated_in_one_program
from sparcml_jax.kernels.merge import merge
from sparcml_jax.kernels.qsgd import qsgd_dequantize, qsgd_quantize
from sparcml_jax.kernels.topk import topk
from sparcml_jax.stream import SparseStream


def _random_stream(rng: np.random.Generator, size: int, k: int) -> SparseStream:
    idx = np.sort(rng.choice(size, k, replace=False)).astype(np.int32)
    return SparseStream(jnp.asarray(idx), jnp.asarray(rng.standard_normal(k).astype(np.float32)), jnp.int32(k), size)


def _merge_seconds(a: SparseStream, b: SparseStream, inner: int, reps: int) -> float:
    """Seconds per ``merge(a, b)`` when run ``inner`` times in one jitted loop."""
    loop = repeated_in_one_program(merge, inner)
    return median_seconds(lambda: loop(a, b), reps) / inner


def _memcpy_seconds(nbytes: int, reps: int) -> float:
    src = np.ones(max(nbytes // 4, 1), np.float32)
    dst = np.empty_like(src)
    return median_seconds(lambda: np.copyto(dst, src), reps)


def run(sizes: list[int], densities: list[float], reps: int) -> list[dict]:
    rng = np.random.default_rng(0)
    results = []
    for size in sizes:
        x = jnp.asarray(rng.standard_normal(size).astype(np.float32))
        key = jax.random.key(0)
        max_abs = jax.jit(lambda v: jnp.max(jnp.abs(v)))
        one_pass = median_seconds(lambda: max_abs(x), reps)
        for bits in (4,):
            quantize = jax.jit(lambda v, k: qsgd_quantize(v, k, bits=bits))
            q = quantize(x, key)
            dequantize = jax.jit(qsgd_dequantize)
            t_q = median_seconds(lambda: quantize(x, key), reps)
            t_dq = median_seconds(lambda: dequantize(q), reps)
            results.append(dict(kernel=f"qsgd_quantize_{bits}bit", size=size, density=None, seconds=t_q,
                                baseline="one memory pass", baseline_seconds=one_pass, ratio=t_q / one_pass))
            results.append(dict(kernel=f"qsgd_dequantize_{bits}bit", size=size, density=None, seconds=t_dq,
                                baseline="one memory pass", baseline_seconds=one_pass, ratio=t_dq / one_pass))
        for density in densities:
            k = max(1, int(size * density))
            ours = jax.jit(lambda v: topk(v, k))
            theirs = jax.jit(lambda v: jax.lax.top_k(jnp.abs(v), k))
            t_ours, t_theirs = median_seconds(lambda: ours(x), reps), median_seconds(lambda: theirs(x), reps)
            results.append(dict(kernel="topk", size=size, density=density, seconds=t_ours,
                                baseline="jax.lax.top_k(|x|)", baseline_seconds=t_theirs, ratio=t_ours / t_theirs))
            a, b = _random_stream(rng, size, k), _random_stream(rng, size, k)
            inner = max(1, min(200, 2_000_000 // k))
            t_merge = _merge_seconds(a, b, inner, reps)
            t_copy = _memcpy_seconds(2 * 8 * k, reps * 5)
            results.append(dict(kernel="merge", size=size, density=density, seconds=t_merge,
                                baseline="memcpy of the input bytes", baseline_seconds=t_copy, ratio=t_merge / t_copy))
    return results


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m sparcml_jax.bench kernels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1 << 20, 1 << 22, 1 << 24])
    parser.add_argument("--densities", type=float, nargs="+", default=[0.001, 0.01])
    parser.add_argument("--reps", type=int, default=11)
    parser.add_argument("--quick", action="store_true", help="small sizes, few repetitions (a smoke run)")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.reps = [1 << 16], 3
    rows = run(args.sizes, args.densities, args.reps)
    print_table(
        ["kernel", "N", "density", "time", "baseline", "baseline time", "ratio"],
        [[r["kernel"], f"2^{int(np.log2(r['size']))}", "-" if r["density"] is None else f"{r['density']:.1%}",
          fmt_time(r["seconds"]), r["baseline"], fmt_time(r["baseline_seconds"]), f"{r['ratio']:.2f}x"] for r in rows],
    )
    print("ratio = kernel time / baseline time (median of repetitions; lower is better)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows
