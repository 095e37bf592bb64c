"""Runs in-rank pytest files under mpirun with a timeout, so a deadlock fails instead of hanging."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent
MPIRUN = Path(sys.executable).parent / "mpirun"

# MPICH busy-polls; with more ranks than the 2 cores these make it yield (as MPICH's own CI does).
OVERSUBSCRIBED_ENV = {
    "MPIR_CVAR_POLLS_BEFORE_YIELD": "1",
    "MPIR_CVAR_CH4_PROGRESS_THROTTLE": "1",
    "MPIR_CVAR_CH4_PROGRESS_THROTTLE_NO_PROGRESS_COUNT": "1",
}
# Tests only: a rank waiting in MPI sleeps when it yields instead of calling sched_yield, which
# leaves it runnable beside the ranks that compile. The rank suites ran 10-15 % faster (P = 3, 5,
# 8). Benchmarks do not take it: it changes what a wait costs, and they time waits.
TEST_ENV = {**OVERSUBSCRIBED_ENV, "MPIR_CVAR_ENABLE_HEAVY_YIELD": "1"}


def run_under_mpirun(nprocs: int, args: list[str], timeout: float,
                     env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu", SPARCML_IN_MPIRUN="1", PYTHONUNBUFFERED="1", **TEST_ENV, **(env or {}))
    cmd = [str(MPIRUN), "-n", str(nprocs), sys.executable, *args]
    try:
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=TESTS.parent)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        raise AssertionError(f"mpirun -n {nprocs} timed out after {timeout}s (deadlock?)\n{out[-4000:]}\n{err[-4000:]}")


def run_pytest_under_mpirun(nprocs: int, test_path: str, timeout: float = 180, extra: list[str] = (),
                            env: dict[str, str] | None = None) -> None:
    """pytest on ``test_path`` (a file or folder; several separated by spaces) in every rank."""
    result = run_under_mpirun(nprocs, ["-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *test_path.split(),
                                       *extra], timeout, env)
    if result.returncode != 0:
        raise AssertionError(
            f"mpirun -n {nprocs} pytest {test_path} failed (rc={result.returncode})\n"
            f"--- stdout ---\n{result.stdout[-6000:]}\n--- stderr ---\n{result.stderr[-6000:]}"
        )
