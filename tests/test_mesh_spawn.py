"""Runs the mesh tests (tests/mesh) in a process of its own with forced CPU devices: XLA fixes
the device count when it starts, and the other tests run on one device.

The process starts when collection ends (tests/conftest.py), so that it compiles beside the
single-process tests: each keeps one of this machine's two cores busy. ``test_mesh`` waits for it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TESTS = Path(__file__).parent
DEVICES = 8
TIMEOUT = 900  # from its start, beside the other tests

_run: dict = {}


def start_in_background() -> None:
    if _run:
        return
    env = dict(os.environ, JAX_PLATFORMS="cpu", SPARCML_ON_MESH="1",
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--maxfail=20", "-rfE", "tests/mesh"]
    _run["output"] = tempfile.TemporaryFile(mode="w+")  # a file: a pipe nobody reads would fill and block it
    _run["started"] = time.monotonic()
    _run["process"] = subprocess.Popen(cmd, env=env, stdout=_run["output"], stderr=subprocess.STDOUT, text=True,
                                       cwd=TESTS.parent)


def stop_background() -> None:
    """Kills the run if the session ends before test_mesh waited for it (-x, Ctrl-C)."""
    if _run and _run["process"].poll() is None:
        _run["process"].kill()
        _run["process"].wait()


def test_mesh():
    start_in_background()
    process, output = _run["process"], _run["output"]
    try:
        process.wait(timeout=max(1.0, TIMEOUT - (time.monotonic() - _run["started"])))
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        output.seek(0)
        raise AssertionError(f"tests/mesh timed out after {TIMEOUT}s\n{output.read()[-8000:]}") from None
    output.seek(0)
    log = output.read()
    assert process.returncode == 0, f"tests/mesh failed\n{log[-8000:]}"
