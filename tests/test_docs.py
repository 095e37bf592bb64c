"""Every docstring example of every module runs (as one process, i.e. P = 1)."""

import doctest
import importlib
from pathlib import Path

import pytest

import sparcml_jax

PACKAGE = Path(sparcml_jax.__file__).parent
SOURCES = {".".join(("sparcml_jax", *p.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(".__init__"): p
           for p in sorted(PACKAGE.rglob("*.py")) if p.name != "__main__.py"}


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_docstring_examples_run(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    assert (result.attempted > 0) == (">>>" in SOURCES[name].read_text())  # no example left unrun
