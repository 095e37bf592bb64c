"""The processes of one ``jax.distributed`` job (spawned by tests/test_distributed_spawn.py): each
joins it before any test, over gloo, XLA:CPU's collectives across processes."""

import os
import sys

import jax

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "mesh"))

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
                           num_processes=int(os.environ["SPARCML_NUM_PROCESSES"]),
                           process_id=int(os.environ["SPARCML_PROCESS_ID"]))
