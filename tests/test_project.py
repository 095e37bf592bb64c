"""``bench project``: the cost model's projection to clusters and its check against runs. The
numbers are the model's; these tests check that the projection prices what it says it prices
(the network's dense allreduce, the messages alone, the local selection SparCML's algorithms
add) and that the CLI writes its table, JSON and plot."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from sparcml_jax import CostModel
from sparcml_jax.bench import project as proj

COMPUTE = CostModel(alpha=3e-6, beta=1.4e-10, dense_alpha=7e-6, dense_beta=7e-10, pair_cost=5e-9,
                    element_cost=4e-10, select_cost=6e-10)
PRICED = ("dense", *proj.SPARCML, "spardl", "gtopk")


def test_the_cluster_dense_allreduce_is_rabenseifners():
    n, net = 1 << 24, proj.NETWORKS["100gbit"]
    for p in (16, 1024):
        wire = proj.cluster_model(CostModel(alpha=0.0, beta=0.0), net, p)
        assert wire.predict("dense", size=n, nnz=n, nprocs=p) == pytest.approx(
            math.log2(p) * net.alpha + 2 * (p - 1) / p * 4 * n * net.beta)
        assert wire.latency(p) == net.alpha  # every other message costs alpha
        model = proj.cluster_model(COMPUTE, net, p)
        assert model.predict("dense", size=n, nnz=n, nprocs=p) > wire.predict("dense", size=n, nnz=n, nprocs=p)


def test_every_algorithm_at_every_p_with_its_ratio_and_its_messages_alone():
    networks = [proj.NETWORKS["1gbit"], proj.NETWORKS["100gbit"]]
    rows = proj.project(COMPUTE, networks, nprocs=(16, 64, 1024), algorithms=PRICED)
    assert len(rows) == 2 * 3 * len(PRICED)
    for r in rows:
        assert r["seconds"] > r["wire_seconds"] > 0, r
        same = [d for d in rows if d["network"] == r["network"] and d["P"] == r["P"] and d["algorithm"] == "dense"]
        assert r["ratio_to_dense"] == pytest.approx(r["seconds"] / same[0]["seconds"])
    one_gbit = {(r["P"], r["algorithm"]): r for r in rows if r["network"] == "1gbit"}
    # 1 Gbit: messages dominate, and the global top-k algorithms keep O(k) on the wire.
    assert one_gbit[(1024, "spardl")]["ratio_to_dense"] < 0.5
    assert one_gbit[(1024, "spardl")]["result_nnz"] < 1.01 * one_gbit[(1024, "spardl")]["k"]
    assert one_gbit[(1024, "ssar_split_allgather")]["note"].startswith("union bound dense")


def test_sparcml_adds_the_local_selection():
    n, k, p = 1 << 24, (1 << 24) // 100, 64
    model = proj.cluster_model(COMPUTE, proj.NETWORKS["100gbit"], p)
    priced = proj.price(model, "ssar_split_allgather", size=n, k=k, nprocs=p)["seconds"]
    collective = model.predict("ssar_split_allgather", size=n, nnz=k, nprocs=p, capacity=k)
    assert priced - collective == pytest.approx(n * COMPUTE.select_cost + (2 * k + 2 * n) * COMPUTE.element_cost)


def test_the_cli_writes_table_json_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    model_file, out, png = tmp_path / "model.json", tmp_path / "projection.json", tmp_path / "projection.png"
    COMPUTE.save(str(model_file))
    proj.main(["--model", str(model_file), "--networks", "1gbit", "mine:1e-6:1e-10", "--nprocs", "16", "32",
               "--algorithms", *PRICED, "--json", str(out), "--plot", str(png)])
    printed = capsys.readouterr().out
    assert "| 16 |" in printed and "| 32 |" in printed and "mine" in printed
    written = json.loads(out.read_text())
    assert {r["network"] for r in written["rows"]} == {"1gbit", "mine"}
    mine = written["assumptions"]["networks"]["mine"]
    assert (mine["alpha"], mine["beta"]) == (1e-6, 1e-10)
    assert written["assumptions"]["compute"]["select_cost"] == COMPUTE.select_cost
    assert png.stat().st_size > 10_000


def test_the_check_compares_a_run_with_the_model_it_measured(tmp_path):
    n, p, density = 1 << 20, 4, 0.01
    fields = {f"model_{f}": v for f, v in dataclasses.asdict(COMPUTE).items()}
    k = round(n * density)
    run_rows = []
    for algorithm, transport, timed_from in (("dense mpi4jax", "-", "x"), ("spardl", "native", "x"),
                                             ("ssar_split_allgather", "native", "x"),
                                             ("ssar_split_allgather", "native", "stream")):
        run_rows.append(dict(P=p, N=n, density=density, algorithm=algorithm, transport=transport,
                             timed_from=timed_from, median=0.01, **fields))
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run_rows))
    checked = {(r["algorithm"], r["timed_from"]): r for r in proj.check([str(path)])}
    assert checked[("spardl", "x")]["predicted"] == pytest.approx(COMPUTE.predict("spardl", size=n, nnz=k, nprocs=p))
    stream = COMPUTE.predict("ssar_split_allgather", size=n, nnz=k, nprocs=p, capacity=k)
    assert checked[("ssar_split_allgather", "stream")]["predicted"] == pytest.approx(stream)
    assert checked[("ssar_split_allgather", "x")]["predicted"] == pytest.approx(
        stream + proj.local_selection_seconds(COMPUTE, n, k, rest=False))
    assert checked[("dense mpi4jax", "x")]["predicted_over_measured"] == pytest.approx(
        COMPUTE.predict("dense", size=n, nnz=n, nprocs=p) / 0.01)
    other = dataclasses.replace(COMPUTE, select_cost=10 * COMPUTE.select_cost)
    again = {(r["algorithm"], r["timed_from"]): r for r in proj.check([str(path)], {p: other})}
    assert again[("spardl", "x")]["predicted"] > checked[("spardl", "x")]["predicted"]
