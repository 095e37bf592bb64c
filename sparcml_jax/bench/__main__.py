"""``python -m sparcml_jax.bench {kernels,allreduce,axis,latency,overlap,train,calibrate,report,project}``:
benchmarks that print ratios against baselines (``allreduce`` over MPI, ``axis`` over a mesh axis
against psum), the cost model's calibration, and its projection to clusters."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    commands = {name: f"sparcml_jax.bench.{name}"
                for name in ("kernels", "allreduce", "axis", "latency", "overlap", "train", "calibrate", "report",
                             "project")}
    if not argv or argv[0] not in commands:
        print(f"usage: python -m sparcml_jax.bench {{{','.join(commands)}}} [options]  (--help for each)")
        raise SystemExit(2)
    import importlib

    importlib.import_module(commands[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    main()
