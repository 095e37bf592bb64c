"""Finds the compiled FFI libraries and registers their targets with XLA (CPU platform).

scikit-build-core editable installs leave the shared libraries in site-packages while
``__file__`` points into the source tree, so every entry of the package ``__path__`` is searched.
``SPARCML_JAX_LIB_DIR`` overrides the search (useful for out-of-tree CMake builds).
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import jax

KERNELS_LIBRARY = "libsparcml_kernels.so"
MPI_LIBRARY = "libsparcml_mpi.so"


def _candidate_dirs() -> list[Path]:
    import sparcml_jax

    dirs = [Path(p) for p in sparcml_jax.__path__]
    override = os.environ.get("SPARCML_JAX_LIB_DIR")
    return ([Path(override)] if override else []) + dirs


def _find(name: str) -> Path:
    for directory in _candidate_dirs():
        candidate = directory / name
        if candidate.exists():
            return candidate
    searched = ", ".join(str(d) for d in _candidate_dirs())
    raise ImportError(
        f"sparcml_jax: {name} not found (searched {searched}). Build the package with "
        "`pip install --no-build-isolation -e .` (or `make install`)."
    )


@functools.cache
def kernels_library() -> ctypes.CDLL:
    return ctypes.CDLL(str(_find(KERNELS_LIBRARY)))


@functools.cache
def mpi_library() -> ctypes.CDLL:
    from mpi4py import MPI  # noqa: F401  (libmpi must be loaded before our library)

    lib = ctypes.CDLL(str(_find(MPI_LIBRARY)))
    _check_same_mpi(lib)
    return lib


def _check_same_mpi(lib: ctypes.CDLL) -> None:
    from mpi4py import MPI

    buf = ctypes.create_string_buffer(8192)
    lib.SparcmlMpiLibraryVersion.argtypes = [ctypes.c_char_p, ctypes.c_int]
    lib.SparcmlMpiLibraryVersion(buf, len(buf))
    ours = buf.value.decode(errors="replace").strip()
    theirs = MPI.Get_library_version().strip()
    if ours.splitlines()[:1] != theirs.splitlines()[:1]:
        raise ImportError(
            "sparcml_jax was built against a different MPI library than mpi4py uses:\n"
            f"  sparcml_jax: {ours.splitlines()[:1]}\n  mpi4py: {theirs.splitlines()[:1]}\n"
            "Rebuild sparcml_jax in the environment that provides mpi4py."
        )


_registered: set[str] = set()


def register_cpu_target(target: str, symbol: str, library: str = "kernels") -> None:
    """Registers ``symbol`` of one of our libraries as the XLA FFI target ``target`` on CPU."""
    if target in _registered:
        return
    lib = kernels_library() if library == "kernels" else mpi_library()
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    _registered.add(target)
