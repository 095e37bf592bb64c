"""``python -m sparcml_jax.bench project``: the cost model, calibrated here, projects every
allreduce to clusters of P = 16 ... 1024 ranks: SparCML's algorithms, the global top-k ones
(SparDL, gTop-k, Ok-Topk once the cost model prices it) and the dense allreduce, each as seconds
and as a ratio to dense, printed as a table and written as JSON and a plot.

    python -m sparcml_jax.bench project --model benchmarks/cost_model_P2.json \\
        --json benchmarks/projection_global_topk.json --plot benchmarks/projection_global_topk.png
    python -m sparcml_jax.bench project --check benchmarks/global_topk_*.json  # the model against runs

The projection is a model, not a measurement. Its assumptions:

- every message costs ``alpha + bytes * beta`` (one per block, part or round, as the definitions
  send them); no contention, no topology, no overlap of messages with each other or with
  computation; the messages of an allgather are priced as log2 P rounds of a Bruck allgather;
- the network's ``alpha`` and ``beta`` come from a preset (``NETWORKS``) or are given; the local
  work (merges per pair, passes per element, selections per value) is this machine's, as the
  calibration measured it with every rank computing at once;
- the dense allreduce is Rabenseifner's (MPICH's for large vectors): ``2 (P - 1) / P * 4 N``
  bytes on the wire, ``(P - 1) / P * N`` additions, latency ``log2 P * alpha``;
- every rank holds k = density * N entries on uniform random supports; SparCML's result density
  follows the union bound (``N (1 - (1 - k / N)^P)``: dense at P = 1024 and 1 %), a global top-k's
  result holds about k entries;
- every algorithm but dense starts from the dense accumulator: SparCML's algorithms add one
  local top-k selection of the stream (and the rest kept for error feedback), priced as the
  global top-k algorithms' own selections are.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path
from typing import Iterable, Sequence

from sparcml_jax.collectives._plan import GLOBAL_TOPK_ALGORITHMS
from sparcml_jax.collectives.cost_model import CostModel
from sparcml_jax.stream import dense_threshold

SPARCML = ("ssar_recursive_doubling", "ssar_split_allgather", "dsar_split_allgather", "sparse_ring")
NPROCS = tuple(1 << j for j in range(4, 11))  # 16 ... 1024


@dataclasses.dataclass(frozen=True)
class Network:
    """An interconnect as the projection assumes it: ``alpha`` seconds per message and ``beta``
    seconds per byte, for every rank at once (no contention)."""

    name: str
    alpha: float
    beta: float
    description: str


NETWORKS = {
    "1gbit": Network("1gbit", 50e-6, 8e-9, "1 Gbit/s Ethernet: 125 MB/s per link, 50 us per MPI message"),
    "100gbit": Network("100gbit", 2e-6, 8e-11, "100 Gbit/s InfiniBand-like: 12.5 GB/s per link, 2 us per MPI message"),
}


def cluster_model(compute: CostModel, network: Network, nprocs: int) -> CostModel:
    """The cost model of ``nprocs`` ranks on ``network`` with ``compute``'s local costs.

    The dense allreduce is Rabenseifner's: per byte of the vector ``2 (P - 1) / P`` bytes on the
    wire and ``(P - 1) / P`` of an addition (two reads and a write of a float32 element); its
    latency is taken as ``log2 P`` messages, which keeps the model's per-round latency
    (``max(alpha, dense_alpha / log2 P)``) at ``alpha`` for every other algorithm.

    Example:
      >>> from sparcml_jax import CostModel
      >>> from sparcml_jax.bench.project import NETWORKS, cluster_model
      >>> compute = CostModel(alpha=0.0, beta=0.0, pair_cost=4e-9, element_cost=4e-10, select_cost=7e-10)
      >>> model = cluster_model(compute, NETWORKS["1gbit"], 1024)
      >>> wire = 2 * 1023 / 1024 * 4 * (1 << 24) / 125e6  # 2 (P - 1) / P * 64 MB at 125 MB/s
      >>> round(wire, 3), round(model.predict("dense", size=1 << 24, nnz=1 << 24, nprocs=1024), 3)
      (1.073, 1.1)
    """
    share = (nprocs - 1) / nprocs
    return dataclasses.replace(
        compute, alpha=network.alpha, beta=network.beta, dense_alpha=math.log2(max(nprocs, 2)) * network.alpha,
        dense_beta=2 * share * network.beta + share * 3 * compute.element_cost / 4)


def local_selection_seconds(model: CostModel, size: int, k: int, *, rest: bool = True) -> float:
    """A rank's top-k of its dense accumulator (the stream SparCML's algorithms reduce): every
    value read by the selection, the k pairs written, and with ``rest`` the rest copied out for
    error feedback, as :meth:`Pricing.select` prices a selection from a dense vector."""
    return size * model.select_cost + (2 * k + (2 * size if rest else 0)) * model.element_cost


def price(model: CostModel, algorithm: str, *, size: int, k: int, nprocs: int, transport: str = "native") -> dict:
    """One algorithm's projected seconds from every rank's dense accumulator, its expected
    result entries and rank 0's bytes sent; ``seconds`` None (and ``note``) when the cost model
    cannot price the algorithm's definition yet."""
    if algorithm == "dense":
        pricing = model.pricing("dense", size=size, nnz=size, nprocs=nprocs, transport=transport)
        return dict(seconds=pricing.seconds, result_nnz=float(size), bytes_sent=pricing.sent, note=None)
    try:
        if algorithm in GLOBAL_TOPK_ALGORITHMS:
            pricing = model.pricing(algorithm, size=size, nnz=k, nprocs=nprocs, transport=transport)
            seconds = pricing.seconds
        else:
            pricing = model.pricing(algorithm, size=size, nnz=k, nprocs=nprocs, transport=transport, capacity=k)
            seconds = pricing.seconds + local_selection_seconds(model, size, k)
    except (AttributeError, NotImplementedError, TypeError) as e:  # an operation Pricing lacks
        return dict(seconds=None, result_nnz=None, bytes_sent=None, note=f"not priced: {type(e).__name__}: {e}")
    note = None
    if algorithm.startswith("ssar") and pricing.result_entries >= dense_threshold(size):
        # auto would hand such a sum to DSAR (see collectives.auto.price).
        note = "union bound dense: the model does not price SSAR here"
    return dict(seconds=seconds, result_nnz=pricing.result_entries, bytes_sent=pricing.sent, note=note)


def project(compute: CostModel, networks: Iterable[Network], *, size: int = 1 << 24, density: float = 0.01,
            nprocs: Sequence[int] = NPROCS, algorithms: Sequence[str] | None = None) -> list[dict]:
    """Rows of (network, P, algorithm): projected seconds and their ratio to dense on the same
    network and P; ``wire_seconds`` prices the messages alone (no local work, as if it were free).

    Example:
      >>> from sparcml_jax import CostModel
      >>> from sparcml_jax.bench.project import NETWORKS, project
      >>> compute = CostModel(alpha=0.0, beta=0.0, pair_cost=4e-9, element_cost=4e-10, select_cost=7e-10)
      >>> rows = project(compute, [NETWORKS["1gbit"]], nprocs=[1024], algorithms=["dense", "spardl", "gtopk"])
      >>> {r["algorithm"]: round(r["ratio_to_dense"], 2) for r in rows}
      {'dense': 1.0, 'spardl': 0.18, 'gtopk': 0.45}
    """
    algorithms = list(algorithms or ("dense", *SPARCML, *GLOBAL_TOPK_ALGORITHMS))
    k = max(1, int(round(density * size)))
    rows = []
    for network in networks:
        for p in nprocs:
            model = cluster_model(compute, network, p)
            wire = cluster_model(CostModel(alpha=0.0, beta=0.0), network, p)  # the messages alone
            dense = price(model, "dense", size=size, k=k, nprocs=p)["seconds"]
            wire_dense = price(wire, "dense", size=size, k=k, nprocs=p)["seconds"]
            for algorithm in algorithms:
                priced = price(model, algorithm, size=size, k=k, nprocs=p)
                seconds, wire_seconds = priced["seconds"], price(wire, algorithm, size=size, k=k, nprocs=p)["seconds"]
                rows.append(dict(network=network.name, P=p, N=size, density=density, k=k, algorithm=algorithm,
                                 ratio_to_dense=None if seconds is None else seconds / dense, **priced,
                                 wire_seconds=wire_seconds,
                                 wire_ratio_to_dense=None if wire_seconds is None else wire_seconds / wire_dense))
    return rows


def assumptions(compute: CostModel, networks: Sequence[Network]) -> dict:
    return dict(
        networks={n.name: dict(alpha=n.alpha, beta=n.beta, description=n.description) for n in networks},
        compute={f: getattr(compute, f) for f in ("pair_cost", "element_cost", "select_cost")},
        model=__doc__.split("Its assumptions:")[1].strip(),
    )


# --------------------------------------------------------------------------- output

LABELS = {"dense": "dense", "ssar_recursive_doubling": "SSAR rec. doubling", "ssar_split_allgather":
          "SSAR split-allgather", "dsar_split_allgather": "DSAR", "sparse_ring": "sparse ring", "spardl": "SparDL",
          "gtopk": "gTop-k", "oktopk": "Ok-Topk"}


def _label(algorithm: str) -> str:
    return LABELS.get(algorithm, algorithm)


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.3g}" if ms < 100 else f"{ms:.0f}"


def table(rows: list[dict], *, wire: bool = False) -> str:
    """Markdown, one table per network: ms (ratio to dense) per algorithm and P, and the fastest;
    with ``wire`` the messages' time alone."""
    out = []
    if wire:
        rows = [dict(r, seconds=r["wire_seconds"], ratio_to_dense=r["wire_ratio_to_dense"]) for r in rows]
    for network in dict.fromkeys(r["network"] for r in rows):
        mine = [r for r in rows if r["network"] == network]
        algorithms = list(dict.fromkeys(r["algorithm"] for r in mine))
        what = "the messages alone" if wire else "ms per allreduce"
        out.append(f"{network}, {what} (ratio to dense); † the union bound reaches the dense switch, where "
                   "the model does not price SSAR (auto hands such sums to DSAR)\n")
        out.append("| P | " + " | ".join(_label(a) for a in algorithms) + " | fastest |")
        out.append("|---" * (len(algorithms) + 2) + "|")
        for p in dict.fromkeys(r["P"] for r in mine):
            cells, priced = [], {}
            for a in algorithms:
                (r,) = [r for r in mine if r["P"] == p and r["algorithm"] == a]
                if r["seconds"] is None:
                    cells.append("–")
                    continue
                priced[a] = r["seconds"]
                mark = "†" if r["note"] and r["note"].startswith("union") else ""
                cells.append(f"{_ms(r['seconds'])} ({r['ratio_to_dense']:.3f}){mark}")
            fastest = min(priced, key=priced.get)
            out.append(f"| {p} | " + " | ".join(cells) + f" | {_label(fastest)} |")
        out.append("")
    return "\n".join(out)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    networks = list(dict.fromkeys(r["network"] for r in rows))
    fig, axes = plt.subplots(2, len(networks), figsize=(6.2 * len(networks), 9.0), squeeze=False)
    styles = {"dense": ("k", "-", "o"), "ssar_recursive_doubling": ("tab:blue", "--", "."),
              "ssar_split_allgather": ("tab:cyan", "--", "."), "dsar_split_allgather": ("tab:green", "--", "."),
              "sparse_ring": ("tab:purple", "--", "."), "spardl": ("tab:red", "-", "s"),
              "gtopk": ("tab:orange", "-", "^"), "oktopk": ("tab:brown", "-", "D")}
    for column, network in enumerate(networks):
        for row, key, what in ((0, "seconds", "messages and local work"), (1, "wire_seconds", "messages alone")):
            ax = axes[row][column]
            mine = [r for r in rows if r["network"] == network and r[key] is not None]
            for a in dict.fromkeys(r["algorithm"] for r in mine):
                points = [(r["P"], r[key]) for r in mine if r["algorithm"] == a]
                color, line, marker = styles.get(a, (None, "--", "."))
                ax.plot(*zip(*points), line, color=color, marker=marker, label=_label(a))
            (first,) = {(r["N"], r["density"]) for r in mine}
            ax.set(xscale="log", yscale="log", xlabel="P (ranks)", ylabel="seconds per allreduce (model)",
                   title=f"{network}, {what}: N = 2^{int(math.log2(first[0]))}, {first[1]:.0%} per rank")
            ax.set_xticks(sorted({r["P"] for r in mine}), [str(p) for p in sorted({r["P"] for r in mine})])
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# --------------------------------------------------------------------------- the model against runs

def check(paths: Sequence[str], models: dict[int, CostModel] | None = None) -> list[dict]:
    """Predicted against measured for the rows of ``bench allreduce --sweep global-topk`` runs:
    every algorithm timed from the dense accumulator, and SparCML's from their streams. The
    model is the one the run measured (its ``model_*`` fields), or ``models[P]`` when given."""
    rows = [row for path in paths for row in json.loads(Path(path).read_text())]
    out = []
    for row in rows:
        algorithm, p, n, k = row["algorithm"], row["P"], row["N"], max(1, int(round(row["N"] * row["density"])))
        model = (models or {}).get(p) or CostModel(**{f.name: row.get(f"model_{f.name}", 0.0)
                                                       for f in dataclasses.fields(CostModel)})
        transport = row["transport"] if row["transport"] != "-" else "native"
        if algorithm.startswith("dense"):
            predicted = model.predict("dense", size=n, nnz=n, nprocs=p)
        elif algorithm in GLOBAL_TOPK_ALGORITHMS:
            predicted = price(model, algorithm, size=n, k=k, nprocs=p, transport=transport)["seconds"]
        elif algorithm in SPARCML:
            predicted = model.predict(algorithm, size=n, nnz=k, nprocs=p, transport=transport, capacity=k)
            if row.get("timed_from") == "x":  # the stream is selected inside the timed call
                predicted += local_selection_seconds(model, n, k, rest=False)
        else:
            continue
        if predicted is None:
            continue
        out.append(dict(P=p, N=n, density=row["density"], network=row.get("network", "local"), algorithm=algorithm,
                        transport=row["transport"], timed_from=row.get("timed_from"), measured=row["median"],
                        predicted=predicted, predicted_over_measured=predicted / row["median"]))
    return out


def check_table(rows: list[dict]) -> str:
    """Markdown: predicted / measured per algorithm (rows) and run (network, density, P)."""
    runs = sorted({(r["network"], r["density"], r["P"]) for r in rows})
    cases = sorted({(r["algorithm"], r["transport"], r["timed_from"]) for r in rows},
                   key=lambda c: (not c[0].startswith("dense"), c[0] not in GLOBAL_TOPK_ALGORITHMS, c))
    ratio = {(r["algorithm"], r["transport"], r["timed_from"], r["network"], r["density"], r["P"]):
             r["predicted_over_measured"] for r in rows}
    out = ["| algorithm | transport | from | " + " | ".join(f"{n} {d:.1%} P={p}" for n, d, p in runs) + " |",
           "|---" * (len(runs) + 3) + "|"]
    for case in cases:
        cells = [f"{ratio[(*case, *run)]:.2f}" if (*case, *run) in ratio else "" for run in runs]
        out.append(f"| {_label(case[0])} | {case[1]} | {case[2]} | " + " | ".join(cells) + " |")
    return "\n".join(out)


# --------------------------------------------------------------------------- CLI

def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m sparcml_jax.bench project", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a calibrated model (JSON of `bench calibrate`): its local costs, and "
                                        "its alpha and beta for --networks calibrated")
    parser.add_argument("--networks", nargs="+", default=["1gbit", "100gbit"],
                        help=f"presets {sorted(NETWORKS)}, 'calibrated' (the model's own alpha and beta) or "
                             "NAME:ALPHA:BETA (seconds per message, seconds per byte)")
    parser.add_argument("--size", type=int, default=1 << 24)
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--nprocs", type=int, nargs="+", default=list(NPROCS))
    parser.add_argument("--algorithms", nargs="+", help="default: dense, SparCML's and every global top-k one")
    parser.add_argument("--json", help="write the rows and the assumptions here")
    parser.add_argument("--plot", help="write the plot here (needs matplotlib)")
    parser.add_argument("--check", nargs="+", metavar="RUN_JSON",
                        help="instead: the model against measured rows of `bench allreduce --sweep global-topk`")
    parser.add_argument("--check-models", nargs="+", metavar="P:MODEL_JSON",
                        help="with --check: the model for P ranks (default: the one each run measured)")
    return parser


def _network(spec: str, compute: CostModel) -> Network:
    if spec in NETWORKS:
        return NETWORKS[spec]
    if spec == "calibrated":
        return Network("calibrated", compute.alpha, compute.beta, "this machine's ping-pong and pairwise exchange")
    name, alpha, beta = spec.split(":")
    return Network(name, float(alpha), float(beta), f"given: alpha {alpha} s, beta {beta} s/B")


def main(argv: list[str] | None = None) -> list[dict]:
    args = _parser().parse_args(argv)
    if args.check:
        models = {int(p): CostModel.load(f) for p, f in (s.split(":", 1) for s in args.check_models or ())}
        rows = check(args.check, models)
        print(check_table(rows))
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
        return rows
    if args.model:
        compute = CostModel.load(args.model)
    else:
        raise SystemExit("--model FILE is needed: write one with "
                         "`mpirun -n 2 python -m sparcml_jax.bench calibrate --out FILE`")
    networks = [_network(spec, compute) for spec in args.networks]
    rows = project(compute, networks, size=args.size, density=args.density, nprocs=args.nprocs,
                   algorithms=args.algorithms)
    print(table(rows))
    print(table(rows, wire=True))
    for r in rows:
        if r["note"] and r["note"].startswith("not priced"):
            print(f"{r['algorithm']}: {r['note']}")
            break
    if args.json:
        Path(args.json).write_text(json.dumps(dict(assumptions=assumptions(compute, networks), model_file=args.model,
                                                   rows=rows), indent=1) + "\n")
    if args.plot:
        plot(rows, args.plot)
    return rows


if __name__ == "__main__":
    main()
