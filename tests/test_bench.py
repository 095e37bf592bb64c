"""The benchmark CLI runs end to end and writes well-formed rows (no timing assertions)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mpi_spawn import run_under_mpirun

from sparcml_jax import ALGORITHMS, CostModel
from sparcml_jax.bench.allreduce import SPARCML_BESIDE_GLOBAL_TOPK
from sparcml_jax.collectives._plan import GLOBAL_TOPK_ALGORITHMS

ROW_KEYS = {"P", "N", "density", "support", "algorithm", "transport", "timed_from", "chosen", "median", "min", "max",
            "ratio_to_dense", "bytes_sent_max", "result_density", "predicted", "network", "calls_per_sample",
            "steal_seconds", "page_faults", "auto_over_best_fixed"}
SHORT_SLICE = Path(__file__).parent.parent / "tools" / "short_slice.py"


def test_quick_allreduce_sweep_and_report(tmp_path):
    out = tmp_path / "quick.json"
    result = run_under_mpirun(2, ["-m", "sparcml_jax.bench", "allreduce", "--quick", "--json", str(out)], timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "vs dense" in result.stdout
    rows = json.loads(out.read_text())
    assert rows and all(ROW_KEYS <= set(r) for r in rows)
    assert {r["algorithm"] for r in rows} >= {"dense mpi4jax", "mpi4py Allreduce (numpy)", "naive allgather+sum",
                                              "allgather+dense sum (DGC)",
                                              "ssar_recursive_doubling", "ssar_split_allgather",
                                              "dsar_split_allgather", "sparse_ring", "auto"}
    assert not {r["algorithm"] for r in rows} & set(GLOBAL_TOPK_ALGORITHMS)  # only --sweep global-topk adds them
    for r in rows:
        assert r["P"] == 2
        if r["bytes_sent_max"] is not None:  # the sparse runs: something sent, a density of the result
            assert r["bytes_sent_max"] > 0 and 0 < r["result_density"] <= 1
        assert (r["auto_over_best_fixed"] is not None) == (r["algorithm"] == "auto")
    report = subprocess.run([sys.executable, "-m", "sparcml_jax.bench", "report", str(out), "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr[-3000:]
    assert "| best SparCML |" in (tmp_path / "report.md").read_text()


def test_global_topk_sweep_beside_sparcml(tmp_path):
    """``--sweep global-topk`` at a tiny size: every global top-k algorithm and SparCML's, from
    the dense accumulator and (SparCML) from its top-k stream, on both transports, beside dense."""
    size, density, nprocs = 4096, 0.01, 2
    k = round(size * density)
    out = tmp_path / "global.json"
    result = run_under_mpirun(nprocs, ["-m", "sparcml_jax.bench", "allreduce", "--sweep", "global-topk", "--sizes",
                                       str(size), "--densities", str(density), "--reps", "2", "--no-baselines",
                                       "--json", str(out)], timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "including the local selection topk(x, k)" in result.stdout
    rows = json.loads(out.read_text())
    assert all(ROW_KEYS <= set(r) and r["P"] == nprocs and r["support"] == "topk" for r in rows)
    transports = ("native", "mpi4jax")
    expected = {("dense mpi4jax", "-", "x")}
    expected |= {(a, t, f) for a in SPARCML_BESIDE_GLOBAL_TOPK for t in transports for f in ("stream", "x")}
    expected |= {(a, t, "x") for a in GLOBAL_TOPK_ALGORITHMS for t in transports}
    by_name = {(r["algorithm"], r["transport"], r["timed_from"]): r for r in rows}
    assert set(by_name) == expected and len(rows) == len(expected)
    for (algorithm, transport, timed_from), r in by_name.items():
        assert r["median"] > 0 and r["ratio_to_dense"] > 0
        if algorithm in GLOBAL_TOPK_ALGORITHMS:  # about k entries whatever P is
            bound = 2 * k + nprocs if algorithm == "oktopk" else k + nprocs  # Ok-Topk: a step between re-evaluations
            assert 0 < r["result_density"] * size <= bound, r
        elif algorithm != "dense mpi4jax":
            # Timed from x, SparCML reduces the very streams of its stream rows: same bytes, same result.
            stream_row = by_name[(algorithm, transport, "stream")]
            assert (r["bytes_sent_max"], r["result_density"]) == (stream_row["bytes_sent_max"],
                                                                  stream_row["result_density"]), (r, stream_row)
            assert r["result_density"] * size >= k
            assert (r["predicted"] is None) == (timed_from == "x")
        if algorithm != "dense mpi4jax":
            assert r["bytes_sent_max"] > 0, r
    report = subprocess.run([sys.executable, "-m", "sparcml_jax.bench", "report", str(out), "--out", str(tmp_path),
                             "--no-plots"], capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr[-3000:]
    text = (tmp_path / "report.md").read_text()
    assert "## Global top-k against SparCML" in text
    assert all(f"| {a} | native |" in text for a in (*GLOBAL_TOPK_ALGORITHMS, *SPARCML_BESIDE_GLOBAL_TOPK))


def test_quick_allreduce_sweep_with_calls_in_one_program(tmp_path):
    out = tmp_path / "in_step.json"
    result = run_under_mpirun(2, ["-m", "sparcml_jax.bench", "allreduce", "--quick", "--no-baselines",
                                  "--calls-per-sample", "3", "--bits", "4", "--bfloat16", "--json", str(out)],
                              timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "3 calls per jitted program" in result.stdout
    rows = json.loads(out.read_text())
    assert rows and all(ROW_KEYS <= set(r) and r["calls_per_sample"] == 3 for r in rows)
    assert {r["chosen"] for r in rows if r["algorithm"] == "auto"} <= {"ssar_recursive_doubling", "ssar_split_allgather",
                                                                     "dsar_split_allgather", "sparse_ring", "dense"}
    # QSGD rows: DSAR codes its dense phases (fewer bytes than float32 DSAR); auto never takes float32 dense.
    for cell in {(r["N"], r["density"]) for r in rows}:
        by = {r["algorithm"]: r for r in rows if (r["N"], r["density"]) == cell}
        assert by["dsar_split_allgather/q4"]["quantize_bits"] == 4 and by["dsar_split_allgather"]["quantize_bits"] is None
        assert by["dsar_split_allgather/q4"]["bytes_sent_max"] < by["dsar_split_allgather"]["bytes_sent_max"]
        assert by["auto/q4"]["chosen"] in ("ssar_recursive_doubling", "ssar_split_allgather", "dsar_split_allgather")
        # bfloat16 rows (native only): 2 bytes per value instead of 4.
        native = {r["algorithm"]: r for r in rows if (r["N"], r["density"]) == cell and r["transport"] == "native"}
        for name in ("ssar_recursive_doubling", "dsar_split_allgather"):
            plain, half = native[name], native[f"{name}/bf16"]
            assert half["value_bits"] == 16 and half["transport"] == "native"
            assert 0.5 * plain["bytes_sent_max"] <= half["bytes_sent_max"] <= 0.75 * plain["bytes_sent_max"]


def test_axis_benchmark_on_forced_devices(tmp_path):
    """``bench axis`` on 2 forced CPU devices (its own process: here JAX started with 1): every
    algorithm and auto (with the model given) beside psum, with the global top-k ones asked for."""
    out, model_file = tmp_path / "axis.json", tmp_path / "model.json"
    CostModel(alpha=2e-5, beta=1e-9).save(str(model_file))
    cmd = [sys.executable, "-m", "sparcml_jax.bench", "axis", "--devices", "2", "--sizes", "4096", "--densities",
           "0.01", "--reps", "2", "--cost-model", str(model_file), "--global-topk", "spardl", "--json", str(out)]
    env = {key: value for key, value in os.environ.items() if key != "XLA_FLAGS"}
    result = subprocess.run(cmd, env=dict(env, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=180,
                            cwd=Path(__file__).parent.parent)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "a message between them is a memory copy" in result.stdout and "vs psum" in result.stdout
    rows = json.loads(out.read_text())
    assert [r["algorithm"] for r in rows] == ["psum", *ALGORITHMS, "auto", "spardl"]
    for r in rows:
        assert (r["N"], r["density"], r["support"], r["D"], r["processes"]) == (4096, 0.01, "uniform", 2, 1)
        assert 0 < r["min"] <= r["median"] <= r["max"] and r["ratio_to_psum"] > 0
        if r["algorithm"] == "psum":
            assert r["ratio_to_psum"] == 1 and r["bytes_sent_max"] is None
        else:  # each device sent something; the result holds at least one device's 41 entries
            assert r["bytes_sent_max"] > 0 and 41 <= r["result_density"] * 4096 <= 4096, r
        assert (r["chosen"] in ALGORITHMS) == (r["algorithm"] == "auto")
        assert (r["auto_over_best_fixed"] is not None) == (r["algorithm"] == "auto")


def test_quick_overlap_benchmark(tmp_path):
    out = tmp_path / "overlap.json"
    result = run_under_mpirun(2, ["-m", "sparcml_jax.bench", "overlap", "--quick", "--json", str(out)], timeout=180)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "hidden fraction" in result.stdout
    data = json.loads(out.read_text())
    assert set(data["median"]) == {"reduce", "blocking", "compute", "sequential", "overlapped", "unpinned"}
    assert all(len(v) == data["reps"] for v in data["samples"].values())


def test_quick_train_benchmark(tmp_path):
    out = tmp_path / "train.json"
    result = run_under_mpirun(2, ["-m", "sparcml_jax.bench", "train", "--quick", "--json", str(out)], timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert {(r["example"], r["run"]) for r in rows} == {
        ("url_logreg", "sparse"), ("url_logreg", "1-line"), ("url_logreg", "dense"),
        ("digits_mlp", "sparse"), ("digits_mlp", "dense"), ("digits_mlp", "bucketed")}
    # The URL runs sum the gradient exactly, so they reach the dense run's loss.
    url = {r["run"]: r["final_loss"] for r in rows if r["example"] == "url_logreg"}
    assert abs(url["sparse"] - url["dense"]) < 1e-5 and abs(url["1-line"] - url["dense"]) < 1e-5, url


FLOOR = "model and optimizer + an allreduce of one float"  # what any communicating step pays
UNORDERED = ("dense step, ordered=False (the engine's MPI_Allreduce)", "sparse step, ordered=False",
             "model and optimizer + an unordered allreduce of one float")


@pytest.mark.parametrize("model", ["digits_mlp", "flax_digits_cnn"])
def test_train_breakdown_takes_an_examples_step_apart(model, tmp_path):
    """The CNN's small leaves (below the default min_size) ride in the fused buffer's collective."""
    out = tmp_path / "breakdown.json"
    result = run_under_mpirun(2, ["-m", "sparcml_jax.bench", "train", "--breakdown", "--quick", "--model", model,
                                  "--json", str(out)], timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = {r["part"]: r for r in json.loads(out.read_text())}
    # As many scalar leaves as the sparse transform's state: the residual of the one fused buffer,
    # QSGD's key and the stats.
    leaves = "dense step + 3 scalar state leaves"
    assert set(rows) == {"dense step", "sparse step", leaves, "model and optimizer only", FLOOR,
                         "+ selection and error feedback", "the collective alone (dsar_split_allgather)",
                         "the dense collective alone", "QSGD 4-bit coding of N / P alone", *UNORDERED}
    assert all(r["ms"] > 0 for r in rows.values()) and rows["dense step"]["vs_dense"] == 1.0
    # One MPI call per step each way, none without communication.
    calls = {part: r["mpi_calls"] for part, r in rows.items()}
    assert calls["dense step"] == calls["sparse step"] == calls[leaves] == calls[FLOOR] == 1
    assert all(calls[part] == 1 for part in UNORDERED)
    assert calls["the collective alone (dsar_split_allgather)"] == calls["the dense collective alone"] == 1
    assert calls["model and optimizer only"] == calls["+ selection and error feedback"] == 0
    assert rows["sparse step"]["messages"] == 2  # at P = 2: the split and the allgather (the agreement rides on them)


def test_train_breakdown_of_the_exact_mode(tmp_path):
    """``--density none``: the step sums every nonzero (nonzeros_allreduce: it agrees first)."""
    out = tmp_path / "breakdown.json"
    result = run_under_mpirun(2, ["-m", "sparcml_jax.bench", "train", "--breakdown", "--quick", "--density", "none",
                                  "--bits", "0", "--algorithm", "dense", "--json", str(out)], timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = {r["part"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"dense step", "sparse step", "dense step + 1 scalar state leaf", "model and optimizer only",
                         FLOOR, "+ packing", "the collective alone (dense)", "the dense collective alone",
                         *UNORDERED}
    assert rows["sparse step"]["mpi_calls"] == rows["the collective alone (dense)"]["mpi_calls"] == 1
    assert rows["sparse step"]["messages"] is None  # MPICH's allreduce's own


def test_mpi_calls_counts_the_communicating_custom_calls():
    from sparcml_jax.bench.train import mpi_calls

    text = ("stablehlo.custom_call @sparcml_mpi_run(%0) stablehlo.custom_call @SparcmlTopk(%1) "
            "stablehlo.custom_call @mpi_allreduce_ffi(%2) stablehlo.custom_call @sparcml_engine_start(%3) "
            "stablehlo.custom_call @sparcml_engine_wait(%4)")
    assert mpi_calls(text) == 3


def test_calibrate_writes_a_model_that_auto_then_uses(tmp_path):
    """``bench calibrate --out`` writes the model; with SPARCML_JAX_COST_MODEL naming it, auto
    chooses with it and measures nothing."""
    model_file = tmp_path / "model.json"
    result = run_under_mpirun(2, ["-m", "sparcml_jax.bench", "calibrate", "--out", str(model_file)], timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    model = CostModel.load(str(model_file))
    assert model.alpha > 0 and model.beta > 0 and model.dense_beta > 0
    code = ("import jax.numpy as jnp; from mpi4py import MPI; import sparcml_jax as sj\n"
            "from sparcml_jax.collectives import auto\n"
            "s = sj.SparseStream.from_dense(jnp.zeros(64).at[MPI.COMM_WORLD.rank].set(1.0), capacity=2)\n"
            "out = sj.sparse_allreduce(s, algorithm='auto')\n"
            "seen = MPI.COMM_WORLD.gather((float(out.to_dense().sum()), len(auto._calibrated)))\n"
            "if MPI.COMM_WORLD.rank == 0: print('SEEN', seen)")
    result = run_under_mpirun(2, ["-c", code], timeout=60, env={"SPARCML_JAX_COST_MODEL": str(model_file)})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "SEEN [(2.0, 0), (2.0, 0)]" in result.stdout, result.stdout  # the sum, and nothing measured
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bench calibrate --out FILE"):
        CostModel.load(str(bad))


def test_quick_latency_benchmark(tmp_path):
    out = tmp_path / "latency.json"
    result = run_under_mpirun(2, ["-m", "sparcml_jax.bench", "latency", "--reps", "5", "--json", str(out)],
                              timeout=180)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert {r["case"] for r in rows} == {"mpi4jax allreduce (1 float32)", "ssar_recursive_doubling", "auto"}
    assert all(r["median"] > 0 and r["first_call_s"] > 0 for r in rows)


@pytest.mark.environment
def test_short_slice_reaches_the_command_and_its_threads():
    probe = ("import threading\n"
             "def slice_us():\n"
             "    return [l for l in open('/proc/thread-self/sched') if l.startswith('se.slice')][0].split(':')[1].strip()\n"
             "seen = []\n"
             "t = threading.Thread(target=lambda: seen.append(slice_us())); t.start(); t.join()\n"
             "print(slice_us(), seen[0])")
    run = subprocess.run([sys.executable, str(SHORT_SLICE), "300", sys.executable, "-c", probe], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    if "sched_setattr" in run.stderr:  # a kernel without custom slices warns and leaves it
        pytest.skip(run.stderr.strip())
    assert run.stdout.split() == ["300000", "300000"]


@pytest.mark.environment
@pytest.mark.parametrize("value", ["fast", "50"])
def test_short_slice_rejects_what_the_kernel_cannot_take(value):
    run = subprocess.run([sys.executable, str(SHORT_SLICE), value, "true"], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode != 0 and "short_slice.py" in run.stderr
