"""The training examples with a global top-k allreduce run under mpirun (two ranks, one epoch):
they finish, every rank holds the same parameters (the examples raise otherwise), and the model
has learned something."""

import re

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
