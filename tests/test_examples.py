"""The training examples run (two ranks under mpirun, or a mesh of forced devices; one epoch):
they finish, every rank or device holds the same parameters (the examples raise otherwise), and
the model has learned something."""

import os
import re
import subprocess
import sys

import pytest
from mpi_spawn import TESTS, run_under_mpirun

EXAMPLES = TESTS.parent / "examples"


@pytest.mark.parametrize("example,args,accuracy", [
    ("digits_mlp.py", ["--algorithm", "spardl", "--epochs", "1"], r"test accuracy sparse (\d\.\d+)"),
    ("flax_digits_cnn.py", ["--algorithms", "gtopk", "--epochs", "1"], r"^\s+gtopk\s+(\d\.\d+)"),
])
def test_example_trains_with_a_global_top_k(example, args, accuracy):
    result = run_under_mpirun(2, [str(EXAMPLES / example), *args], timeout=180)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    found = re.search(accuracy, result.stdout, re.MULTILINE)
    assert found and float(found.group(1)) > 0.3, result.stdout[-3000:]  # chance: 0.1


def test_cnn_example_trains_unordered():
    """``--unordered``: the transform's collective without JAX's ordered effect."""
    result = run_under_mpirun(2, [str(EXAMPLES / "flax_digits_cnn.py"), "--algorithms", "auto", "--unordered",
                                  "--epochs", "1"], timeout=180)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    found = re.search(r"^\s+auto\s+(\d\.\d+)", result.stdout, re.MULTILINE)
    assert found and float(found.group(1)) > 0.3, result.stdout[-3000:]  # chance: 0.1


def test_mesh_example_replaces_pmean():
    result = subprocess.run([sys.executable, str(EXAMPLES / "flax_data_parallel.py"), "--devices", "3", "--epochs", "2",
                             "--report-every", "1"], env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True,
                            text=True, timeout=180)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for run in ("pmean", r"top-k 1% 4-bit"):
        found = re.search(rf"^\s+{run}\s+(\d\.\d+)", result.stdout, re.MULTILINE)
        assert found and float(found.group(1)) > 0.3, result.stdout[-3000:]  # chance: 0.1
