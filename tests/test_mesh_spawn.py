"""Runs the mesh tests (tests/mesh) in a process of its own with forced CPU devices: XLA fixes
the device count when it starts, and the other tests run on one device."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent
DEVICES = 8
TIMEOUT = 600


def test_mesh():
    env = dict(os.environ, JAX_PLATFORMS="cpu", SPARCML_ON_MESH="1",
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--maxfail=20", "-rfE", "tests/mesh"]
    try:
        result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT, cwd=TESTS.parent)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"tests/mesh timed out after {TIMEOUT}s\n{e.stdout}\n{e.stderr}") from None
    assert result.returncode == 0, f"tests/mesh failed\n{result.stdout[-8000:]}\n{result.stderr[-4000:]}"
