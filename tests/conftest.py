import os

import jax

jax.config.update("jax_platforms", "cpu")
# Compiling dominates the tests (hundreds of small programs, 8 ranks on 2 cores). LLVM's cheaper
# optimization of XLA's generated code takes about a third less CPU time, and XLA:CPU's classic
# fusion emitters compile the mpi4jax transport's long unrolled schedules in less than half the
# time of its MLIR emitters (P = 3, Ok-Topk: 11.8 s against 27.6 s of compilation). They change
# how fast that code runs, not what it computes (no fast-math either way); the C kernels are
# compiled as always. Processes spawned by the tests inherit them.
_CHEAP_COMPILE = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                  "--xla_cpu_use_fusion_emitters=false")
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_CHEAP_COMPILE}".strip()

# tests/mpi holds in-rank tests: they run only under mpirun, spawned by tests/test_mpi_spawn.py.
collect_ignore = [] if os.environ.get("SPARCML_IN_MPIRUN") else ["mpi"]
# tests/mesh needs forced CPU devices: it runs in its own process, spawned by tests/test_mesh_spawn.py.
if not os.environ.get("SPARCML_ON_MESH"):
    collect_ignore.append("mesh")
# tests/distributed joins a jax.distributed job: its processes are spawned by tests/test_distributed_spawn.py.
if not os.environ.get("SPARCML_DISTRIBUTED"):
    collect_ignore.append("distributed")


def pytest_collection_modifyitems(session, config, items):
    """The multi-rank runs go last, after the mesh tests' wait (see pytest_collection_finish)."""
    last = [item for item in items if item.nodeid.startswith("tests/test_mpi_spawn.py::test_mpi_ranks")]
    waits = [item for item in items if item.nodeid.startswith("tests/test_mesh_spawn.py::")]
    items[:] = [item for item in items if item not in last and item not in waits] + waits + last


def pytest_collection_finish(session):
    """Starts the spawned runs that compile on one core beside the single-process tests."""
    if session.config.option.collectonly:
        return
    for module in _background_modules(session):
        module.start_in_background()


def pytest_sessionfinish(session, exitstatus):
    for module in _background_modules(session):
        module.stop_background()


def _background_modules(session) -> set:
    return {item.module for item in getattr(session, "items", []) if hasattr(item.module, "start_in_background")}
