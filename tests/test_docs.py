"""Every docstring example of the public modules runs (as one process, i.e. P = 1)."""

import doctest
import importlib

import pytest

MODULES = [
    "sparcml_jax.stream", "sparcml_jax.kernels.merge", "sparcml_jax.collectives",
    "sparcml_jax.collectives.dense", "sparcml_jax.collectives.cost_model", "sparcml_jax.comm.simulated",
    "sparcml_jax.transform",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
