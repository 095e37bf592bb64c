"""sparcml_jax: SparCML sparse and low-precision gradient communication for JAX.

Kernels (C behind the XLA FFI on CPU, pure jnp elsewhere), sparse collectives over MPI that run
inside ``jax.jit``, and an optax transformation for data-parallel training.
"""

from sparcml_jax.collectives import (
    ALGORITHMS,
    AllreduceStats,
    CostModel,
    dense_allreduce,
    sparse_allgather,
    sparse_allreduce,
)
from sparcml_jax.kernels.merge import merge, merge_capacity, merge_reference
from sparcml_jax.kernels.partition import (
    from_dense,
    from_dense_reference,
    gather,
    gather_reference,
    partition_bounds,
    scatter_add,
    scatter_add_reference,
    split,
    split_reference,
)
from sparcml_jax.stream import SparseStream, dense_threshold

__all__ = [
    "ALGORITHMS",
    "AllreduceStats",
    "CostModel",
    "SparseStream",
    "dense_allreduce",
    "dense_threshold",
    "from_dense",
    "from_dense_reference",
    "gather",
    "gather_reference",
    "merge",
    "merge_capacity",
    "merge_reference",
    "partition_bounds",
    "scatter_add",
    "scatter_add_reference",
    "sparse_allgather",
    "sparse_allreduce",
    "split",
    "split_reference",
]
