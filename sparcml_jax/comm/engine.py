"""The progress engine's two FFI ops (ffi/bindings/mpi_engine.cc), on mpi4jax's ordered effect.

``start`` copies the stream into a job for the engine's background thread and returns the job id
at once; ``wait`` blocks until that job is done. Both carry the ordered-effect token, so they run
in program order with every other MPI call; the id is the data dependency that ties them.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
from mpi4py import MPI

from sparcml_jax import _lib
from sparcml_jax.comm._ordered import i64, ordered_ffi_primitive
from sparcml_jax.stream import INDEX_DTYPE, VALUE_DTYPE, SparseStream

_ShapedArray = jax.core.ShapedArray
# How long exit waits for reductions in flight (their peers must run them too).
EXIT_TIMEOUT_ENV = "SPARCML_JAX_EXIT_TIMEOUT"

_start_p = ordered_ffi_primitive(
    "sparcml_engine_start", "sparcml_engine_start", "SparcmlEngineStart",
    lambda *avals, **_: [_ShapedArray((), INDEX_DTYPE)],
)
_wait_p = ordered_ffi_primitive(
    "sparcml_engine_wait", "sparcml_engine_wait", "SparcmlEngineWait",
    lambda job, *after, capacity: [
        _ShapedArray((int(capacity),), INDEX_DTYPE), _ShapedArray((int(capacity),), VALUE_DTYPE),
        _ShapedArray((), INDEX_DTYPE), _ShapedArray((), INDEX_DTYPE), _ShapedArray((), VALUE_DTYPE),
        _ShapedArray((), INDEX_DTYPE),
    ],
    shape_params=("capacity",),
)


def start(s: SparseStream, *, comm: MPI.Comm, delta: float, signature: dict[str, int],
          choice_nnz: tuple[int, ...], choice_algorithm: tuple[int, ...], key_words: jax.Array | None = None,
          quantize_bits: int | None = None, bucket_size: int = 1024, quantize_scale: str = "max") -> jax.Array:
    """Submits the allreduce of ``s`` and returns its job id (int32 scalar).

    The engine runs ``choice_algorithm[i]`` for the first ``i`` with ``choice_nnz[i] >=`` the
    largest nnz over ranks, after the ranks agreed on ``signature`` and validated their streams.
    ``key_words`` (uint32[2], this rank's) drive QSGD when ``quantize_bits`` is set.
    """
    _shutdown_at_exit()
    key_words = jnp.zeros((2,), jnp.uint32) if key_words is None else key_words
    (job,) = _start_p.bind(
        s.indices, s.values, s.nnz, key_words, comm=i64(comm.py2f()), n=i64(s.size), delta=float(delta),
        signature=tuple(int(v) for v in signature.values()), fields=",".join(signature),
        choice_nnz=tuple(choice_nnz), choice_algorithm=tuple(choice_algorithm),
        quantize_bits=i64(quantize_bits or 0), bucket_size=i64(bucket_size), quantize_scale=quantize_scale,
    )
    return job


def wait(job: jax.Array, *, size: int, capacity: int, after=()):
    """Blocks until job ``job`` is done; returns (result stream, algorithm, bytes sent, dense round).

    The arrays of ``after`` become operands (unread), so XLA computes them before the wait.
    """
    idx, val, nnz, algorithm, sent, dense_round = _wait_p.bind(job, *jax.tree.leaves(after), capacity=i64(capacity))
    return SparseStream(idx, val, nnz, size), algorithm, sent, dense_round


@functools.cache
def _shutdown_at_exit() -> None:
    # Registered after mpi4py's import, so it runs before MPI_Finalize.
    atexit.register(_shutdown)


def _shutdown() -> None:
    """Lets reductions still in flight finish (every rank runs them), then stops the engine.

    If they cannot finish, a peer never started its part: the job can only be ended by aborting,
    which beats hanging in MPI_Finalize.
    """
    lib = _lib.mpi_library()
    if not hasattr(lib, "SparcmlEngineShutdown"):  # a stale build: start failed to lower, nothing runs
        return
    lib.SparcmlEngineShutdown.restype = int
    lib.SparcmlEngineShutdown.argtypes = [ctypes.c_double]
    timeout = float(os.environ.get(EXIT_TIMEOUT_ENV, "30"))
    if not lib.SparcmlEngineShutdown(timeout):
        print(f"sparcml_jax: a non-blocking allreduce was still in flight at exit and its peers did not complete "
              f"it within {timeout:g} s ({EXIT_TIMEOUT_ENV}); aborting the MPI job", file=sys.stderr, flush=True)
        time.sleep(0.5)  # lets mpiexec forward the message before the abort takes the job down
        MPI.COMM_WORLD.Abort(1)

