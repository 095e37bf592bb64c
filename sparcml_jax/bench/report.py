"""Turns JSON rows of ``bench allreduce`` runs (one file per P and network) into markdown tables
and paper-style plots: time versus density per algorithm beside the dense line, and speedup
versus P. Plots need the optional matplotlib (``pip install sparcml_jax[plots]``).

    python -m sparcml_jax.bench report results/*.json --out results/

Runs of ``bench allreduce --sweep global-topk`` add the global top-k tables: every algorithm's
time from the dense accumulator, its ratio to dense, and its result density and bytes per rank.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path

SPARSE = ("ssar_recursive_doubling", "ssar_split_allgather", "dsar_split_allgather", "sparse_ring")
GLOBAL_TOPK = ("spardl", "oktopk", "gtopk")


def load(paths: list[str]) -> list[dict]:
    rows = []
    for path in paths:
        for row in json.loads(Path(path).read_text()):
            row.setdefault("network", "local")
            row.setdefault("calls_per_sample", 1)
            dense_input = row["algorithm"].startswith("dense") or row["algorithm"].startswith("mpi4py")
            row.setdefault("timed_from", "x" if dense_input else "stream")
            rows.append(row)
    return rows


def summary_table(rows: list[dict]) -> str:
    """Per cell: dense, the best SparCML algorithm, auto and the baselines, as ratios to dense."""
    cells = defaultdict(dict)
    for r in rows:
        if r["timed_from"] == "x" and (r["algorithm"] in (*SPARSE, "auto") or r["algorithm"] in GLOBAL_TOPK):
            continue  # SparCML's collectives are compared on their streams (the global top-k tables: from x)
        key = (r["network"], r["calls_per_sample"], r["P"], r["N"], r["support"], r["density"])
        cells[key][(r["algorithm"], r["transport"])] = r
    lines = ["| network | calls per program | P | N | support | density | dense ms | best SparCML | best / dense "
             "| auto / dense | auto / best fixed | naive allgather / best | DGC allgather / best | mpi4py numpy / dense |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (network, calls, p, n, support, density), c in sorted(cells.items()):
        dense = c.get(("dense mpi4jax", "-"))
        sparse = [r for (a, _), r in c.items() if a in SPARSE]
        if not dense or not sparse:
            continue
        best = min(sparse, key=lambda r: r["median"])
        autos = [r for (a, _), r in c.items() if a == "auto"]
        auto = min(autos, key=lambda r: r["median"]) if autos else None
        over_fixed = auto.get("auto_over_best_fixed") if auto else None
        naive_best = _fastest(c, "naive allgather+sum")
        dgc_best = _fastest(c, "allgather+dense sum (DGC)")
        numpy = c.get(("mpi4py Allreduce (numpy)", "-"))

        def ratio(a, b, digits=3):
            return "" if a is None or b is None else f"{a['median'] / b['median']:.{digits}f}"

        lines.append(
            f"| {network} | {calls} | {p} | 2^{int(math.log2(n))} | {support} | {density:.2%} | {dense['median'] * 1e3:.2f} | "
            f"{best['algorithm']} ({best['transport']}) | {ratio(best, dense)} | {ratio(auto, dense)} | "
            f"{'' if over_fixed is None else f'{over_fixed:.2f}'} | {ratio(naive_best, best, 2)} | "
            f"{ratio(dgc_best, best, 2)} | "
            f"{ratio(numpy, dense)} |")
    return "\n".join(lines)


def _fastest(cell: dict, algorithm: str) -> dict | None:
    """The faster transport's row of ``algorithm`` in a cell, if it was measured."""
    rows = [r for (a, _), r in cell.items() if a == algorithm]
    return min(rows, key=lambda r: r["median"]) if rows else None


def model_table(rows: list[dict], min_bytes: float = 1e6) -> str:
    """Measured over predicted time for the SparCML rows and the dense baseline that send more
    than ``min_bytes`` per rank: the model is there to choose algorithms and explain results."""
    lines = ["| network | P | N | support | density | algorithm | transport | MB sent | measured ms | model ms "
             "| measured / model |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["network"], r["P"], r["N"], r["support"], r["density"], r["algorithm"])):
        if r["algorithm"] not in (*SPARSE, "dense mpi4jax") or not r.get("predicted"):
            continue
        dense_volume = 2 * (r["P"] - 1) / r["P"] * 4 * r["N"]  # reduce-scatter + allgather
        sent = r.get("bytes_sent_max") or (dense_volume if r["algorithm"].startswith("dense") else 0)
        if sent < min_bytes:
            continue
        lines.append(f"| {r['network']} | {r['P']} | 2^{int(math.log2(r['N']))} | {r['support']} | {r['density']:.2%} | "
                     f"{r['algorithm']} | {r['transport']} | {sent / 1e6:.2f} | {r['median'] * 1e3:.2f} | "
                     f"{r['predicted'] * 1e3:.2f} | {r['median'] / r['predicted']:.2f} |")
    return "\n".join(lines)


def global_topk_tables(rows: list[dict]) -> str:
    """Per network and N, the global top-k allreduces beside SparCML's algorithms and dense,
    one column per (density, P): the median time from each rank's dense accumulator ``x`` with
    its ratio to dense and, for SparCML, its collective alone in brackets; then the result
    density and the MB sent per rank (the maximum over ranks)."""
    grids = defaultdict(list)
    for r in rows:
        grids[(r["network"], r["calls_per_sample"], r["N"])].append(r)
    sections = []
    for (network, calls, n), rs in sorted(grids.items()):
        if not any(r["algorithm"] in GLOBAL_TOPK for r in rs):
            continue
        columns = sorted({(r["density"], r["P"]) for r in rs})
        by = {(r["algorithm"], r["transport"], r["timed_from"], r["density"], r["P"]): r for r in rs}
        names = [("dense mpi4jax", "-")]
        for algorithm in ("auto", *SPARSE, *GLOBAL_TOPK):
            names += sorted({(a, t) for a, t, f, _, _ in by if a == algorithm and f == "x"},
                            key=lambda name: name[1] != "native")
        head = "| algorithm | transport | " + " | ".join(f"{d:.1%} P={p}" for d, p in columns) + " |"
        rule = "|---|---|" + "---|" * len(columns)
        times, volumes = [head, rule], [head, rule]
        for algorithm, transport in names:
            time_cells, volume_cells = [], []
            for density, p in columns:
                r = by.get((algorithm, transport, "x", density, p))
                alone = by.get((algorithm, transport, "stream", density, p))
                if r is None:
                    time_cells.append("")
                    volume_cells.append("")
                    continue
                cell = f"{r['median'] * 1e3:.2f} ({r['ratio_to_dense']:.2f}x)"
                time_cells.append(cell + (f" [{alone['median'] * 1e3:.2f}]" if alone else ""))
                if r["bytes_sent_max"] is None:
                    volume_cells.append(f"100% / {2 * (p - 1) / p * 4 * r['N'] / 1e6:.1f}")  # reduce-scatter + allgather
                else:
                    chosen = f" ({r['chosen']})" if algorithm == "auto" and r.get("chosen") else ""
                    volume_cells.append(f"{r['result_density']:.2%} / {r['bytes_sent_max'] / 1e6:.2f}{chosen}")
            times.append(f"| {algorithm} | {transport} | " + " | ".join(time_cells) + " |")
            volumes.append(f"| {algorithm} | {transport} | " + " | ".join(volume_cells) + " |")
        title = f"{network}, N = 2^{int(math.log2(n))}" + ("" if calls == 1 else f", {calls} calls per program")
        sections.append(
            f"### {title}: ms from x (ratio to dense) [SparCML's collective alone]\n\n" + "\n".join(times)
            + f"\n\n### {title}: result density / MB sent per rank\n\n" + "\n".join(volumes))
    return "\n\n".join(sections)


def plots(rows: list[dict], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    groups = defaultdict(list)
    for r in rows:
        if r["support"] == "uniform":
            groups[(r["network"], r["P"], r["N"])].append(r)
    for (network, p, n), rs in sorted(groups.items()):
        densities = sorted({r["density"] for r in rs})
        if len(densities) < 3:
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        for (algorithm, transport) in sorted({(r["algorithm"], r["transport"]) for r in rs}):
            pts = sorted((r["density"], r["median"] * 1e3) for r in rs
                         if (r["algorithm"], r["transport"]) == (algorithm, transport))
            style = dict(color="black", linewidth=2) if algorithm.startswith("dense") else {}
            ax.plot(*zip(*pts), marker="o", label=f"{algorithm} {'' if transport == '-' else transport}", **style)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("density per rank")
        ax.set_ylabel("time [ms] (median, max over ranks)")
        ax.set_title(f"allreduce of 2^{int(math.log2(n))} float32, P={p}, {network}")
        ax.legend(fontsize=6)
        fig.tight_layout()
        path = out / f"time_vs_density_{network}_P{p}_N{int(math.log2(n))}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    speed = defaultdict(dict)
    for r in rows:
        if r["support"] == "uniform" and r["algorithm"] in SPARSE:
            key = (r["network"], r["N"], r["density"])
            dense = next((d for d in rows if d["algorithm"] == "dense mpi4jax" and d["P"] == r["P"]
                          and d["N"] == r["N"] and d["density"] == r["density"] and d["network"] == r["network"]
                          and d["support"] == "uniform"), None)
            if dense:
                best = speed[key].get(r["P"], 0)
                speed[key][r["P"]] = max(best, dense["median"] / r["median"])
    series = {k: v for k, v in speed.items() if len(v) >= 2}
    if series:
        fig, ax = plt.subplots(figsize=(6, 4))
        for (network, n, density), by_p in sorted(series.items()):
            ps = sorted(by_p)
            ax.plot(ps, [by_p[p] for p in ps], marker="o", label=f"{network} 2^{int(math.log2(n))} {density:.2%}")
        ax.axhline(1.0, color="black", linewidth=1)
        ax.set_xlabel("P (ranks)")
        ax.set_ylabel("speedup of the best SparCML algorithm over dense")
        ax.set_yscale("log")
        ax.legend(fontsize=6)
        fig.tight_layout()
        path = out / "speedup_vs_P.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m sparcml_jax.bench report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", help="JSON files written by `bench allreduce --json`")
    parser.add_argument("--out", default=".", help="directory for report.md and the PNG plots")
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = load(args.files)
    # The model prices one jitted call (dispatch included), as do the plots: the rows of runs
    # with several calls per program appear in the summary only.
    per_call = [r for r in rows if r["calls_per_sample"] == 1]
    text = ("## Summary\n\n" + summary_table(rows) + "\n\n## Measured vs model (messages above 1 MB)\n\n"
            + model_table(per_call))
    global_topk = global_topk_tables(rows)
    if global_topk:
        text += "\n\n## Global top-k against SparCML\n\n" + global_topk
    written = []
    if not args.no_plots:
        try:
            written = plots(per_call, out)
        except ImportError:
            print("matplotlib is not installed: no plots (pip install sparcml_jax[plots])")
    text += "\n\n" + "\n".join(f"![{p.stem}]({p.name})" for p in written) + "\n"
    (out / "report.md").write_text(text)
    print(text)
