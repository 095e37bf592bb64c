import os

import jax

jax.config.update("jax_platforms", "cpu")

# tests/mpi holds in-rank tests: they run only under mpirun, spawned by tests/test_mpi_spawn.py.
collect_ignore = [] if os.environ.get("SPARCML_IN_MPIRUN") else ["mpi"]
# tests/mesh needs forced CPU devices: it runs in its own process, spawned by tests/test_mesh_spawn.py.
if not os.environ.get("SPARCML_ON_MESH"):
    collect_ignore.append("mesh")
# tests/distributed joins a jax.distributed job: its processes are spawned by tests/test_distributed_spawn.py.
if not os.environ.get("SPARCML_DISTRIBUTED"):
    collect_ignore.append("distributed")
