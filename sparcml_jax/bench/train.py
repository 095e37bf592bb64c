"""End-to-end benchmark (run under mpirun): the training examples, sparse beside dense.

Runs ``examples/url_logreg.py`` (exact sparse sums, the paper's URL experiment in miniature) and
``examples/digits_mlp.py`` (top-k + error feedback + QSGD, optionally bucketed on the non-blocking
engine) from a source checkout, and prints per run the median step time, the final quality, and
the training time until the epoch loss first reaches the target: the worst final loss of the
example's runs times (1 + --tolerance), a loss every run reaches.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

from mpi4py import MPI

from sparcml_jax.bench._timing import print_table

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _example(name: str):
    path = EXAMPLES / f"{name}.py"
    if not path.exists():
        raise SystemExit(f"bench train runs the examples of a source checkout; {path} not found")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def time_to_target(losses: list[float], times: list[float], target: float) -> float | None:
    """Training seconds until the loss first reaches ``target`` (None if it never does)."""
    return next((t for loss, t in zip(losses, times) if loss <= target), None)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="mpirun -n P python -m sparcml_jax.bench train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--examples", nargs="+", default=["url_logreg", "digits_mlp"], choices=["url_logreg", "digits_mlp"])
    p.add_argument("--tolerance", type=float, default=0.05, help="target = worst final loss * (1 + tolerance)")
    p.add_argument("--buckets", type=int, default=2, help="digits: also run the bucketed transform (0: no)")
    p.add_argument("--quick", action="store_true", help="small data and few epochs (a smoke run)")
    p.add_argument("--json", help="write the rows to this JSON file (rank 0)")
    args = p.parse_args(argv)
    rank = MPI.COMM_WORLD.Get_rank()

    rows = []
    if "url_logreg" in args.examples:
        url = _example("url_logreg").main(["--samples", "20000", "--features", str(1 << 18), "--epochs", "2"]
                                          if args.quick else [])
        target = max(h["loss"][-1] for h in url.values()) * (1 + args.tolerance)
        for run, h in url.items():
            rows.append(dict(example="url_logreg", run=run, step_ms=h["step_ms"][-1], final_loss=h["loss"][-1],
                             quality=h["test_accuracy"], target_loss=target,
                             time_to_target_s=time_to_target(h["loss"], h["time_s"], target)))
    if "digits_mlp" in args.examples:
        digits = _example("digits_mlp").main((["--epochs", "4", "--report-every", "2"] if args.quick else [])
                                             + ["--buckets", str(args.buckets)])
        target = max(r["history"]["loss"][-1] for r in digits.values()) * (1 + args.tolerance)
        for run, r in digits.items():
            h = r["history"]
            rows.append(dict(example="digits_mlp", run=run, step_ms=r["step_ms"], final_loss=h["loss"][-1],
                             quality=r["accuracy"], target_loss=target,
                             time_to_target_s=time_to_target(h["loss"], h["time_s"], target)))
    if rank == 0:
        print_table(["example", "run", "step (ms)", "final loss", "test accuracy", "target loss", "time to target (s)"],
                    [[r["example"], r["run"], f"{r['step_ms']:.2f}", f"{r['final_loss']:.4f}", f"{r['quality']:.4f}",
                      f"{r['target_loss']:.4f}",
                      "not reached" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.2f}"]
                     for r in rows])
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
