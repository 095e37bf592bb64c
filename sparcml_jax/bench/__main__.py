"""``python -m sparcml_jax.bench {kernels,allreduce,overlap,train,report}``: benchmarks that print ratios against baselines."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"kernels": "sparcml_jax.bench.kernels", "allreduce": "sparcml_jax.bench.allreduce",
                "overlap": "sparcml_jax.bench.overlap", "train": "sparcml_jax.bench.train",
                "report": "sparcml_jax.bench.report"}
    if not argv or argv[0] not in commands:
        print(f"usage: python -m sparcml_jax.bench {{{','.join(commands)}}} [options]  (--help for each)")
        raise SystemExit(2)
    import importlib

    from sparcml_jax.bench._time_slice import apply_from_environment

    apply_from_environment()  # before JAX starts its threads, which then inherit the slice
    importlib.import_module(commands[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    main()
