"""Runs tests/distributed in 2 processes x 2 forced CPU devices joined by ``jax.distributed`` on
localhost (gloo): the mesh axis spans both processes. Each process has a timeout, so a hang
fails the test."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TESTS = Path(__file__).parent
PROCESSES, DEVICES_PER_PROCESS, TIMEOUT = 2, 2, 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_across_processes():
    address = f"localhost:{_free_port()}"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", "tests/distributed"]
    procs, outputs = [], []
    for process_id in range(PROCESSES):
        env = dict(os.environ, JAX_PLATFORMS="cpu", SPARCML_DISTRIBUTED="1", JAX_COORDINATOR_ADDRESS=address,
                   SPARCML_NUM_PROCESSES=str(PROCESSES), SPARCML_PROCESS_ID=str(process_id),
                   XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} "
                             f"--xla_force_host_platform_device_count={DEVICES_PER_PROCESS}")
        outputs.append(tempfile.TemporaryFile(mode="w+"))  # files: a pipe read after the other process would fill
        procs.append(subprocess.Popen(cmd, env=env, cwd=TESTS.parent, text=True, stdout=outputs[-1],
                                      stderr=subprocess.STDOUT))
    deadline = time.monotonic() + TIMEOUT
    try:
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        raise AssertionError(f"tests/distributed timed out after {TIMEOUT}s (a process hangs)") from None
    for process_id, (proc, out) in enumerate(zip(procs, outputs)):
        out.seek(0)
        assert proc.returncode == 0, f"process {process_id} failed\n{out.read()[-6000:]}"
