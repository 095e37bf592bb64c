"""sparcml_jax: SparCML sparse and low-precision gradient communication for JAX.

Kernels (C behind the XLA FFI on CPU, pure jnp elsewhere), sparse collectives over MPI that run
inside ``jax.jit``, and an optax transformation for data-parallel training.
"""

from sparcml_jax.collectives import (
    reset_after_error,
    ALGORITHMS,
    AllreduceStats,
    CostModel,
    dense_allreduce,
    nonzeros_allreduce,
    sparse_allgather,
    sparse_allreduce,
)
from sparcml_jax.collectives._plan import GLOBAL_TOPK_ALGORITHMS
from sparcml_jax.collectives.global_topk import GlobalTopkStats, OktopkState, global_topk_allreduce, init_oktopk_state
from sparcml_jax.collectives.nonblocking import (
    OVERLAP_COMPILER_OPTIONS,
    AllreduceHandle,
    sparse_allreduce_start,
    sparse_allreduce_wait,
)
from sparcml_jax.kernels.merge import merge, merge_capacity, merge_reference
from sparcml_jax.kernels.partition import (
    coalesce,
    coalesce_reference,
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
from sparcml_jax.kernels.qsgd import (
    QuantizedVector,
    qsgd_dequantize,
    qsgd_dequantize_reference,
    qsgd_quantize,
    qsgd_quantize_reference,
    qsgd_wire_bytes,
)
from sparcml_jax.kernels.topk import topk, topk_reference
from sparcml_jax.sparse_updates import apply_updates, lazy
from sparcml_jax.stream import SparseStream, dense_threshold
from sparcml_jax.stages import (
    ErrorFeedbackState,
    GlobalTopkState,
    GradientStats,
    ReduceState,
    SparsifyState,
    densify,
    error_feedback,
    global_topk_reduce,
    reduce_streams,
    sparsify,
)
from sparcml_jax.transform import (
    AllreduceGradientsState,
    FusedBuffers,
    LeafGroups,
    LeafPlan,
    allreduce_gradients,
    dense_allreduce_gradients,
    fuse_leaves,
    plan_leaves,
    unfuse_leaves,
)
from sparcml_jax import sparsifiers

__all__ = [
    "ALGORITHMS",
    "GLOBAL_TOPK_ALGORITHMS",
    "AllreduceGradientsState",
    "AllreduceHandle",
    "AllreduceStats",
    "CostModel",
    "ErrorFeedbackState",
    "FusedBuffers",
    "GlobalTopkState",
    "GlobalTopkStats",
    "GradientStats",
    "LeafGroups",
    "LeafPlan",
    "OVERLAP_COMPILER_OPTIONS",
    "OktopkState",
    "QuantizedVector",
    "ReduceState",
    "SparseStream",
    "SparsifyState",
    "allreduce_gradients",
    "apply_updates",
    "coalesce",
    "coalesce_reference",
    "dense_allreduce",
    "dense_allreduce_gradients",
    "dense_threshold",
    "densify",
    "error_feedback",
    "from_dense",
    "from_dense_reference",
    "fuse_leaves",
    "gather",
    "gather_reference",
    "global_topk_allreduce",
    "global_topk_reduce",
    "init_oktopk_state",
    "lazy",
    "merge",
    "merge_capacity",
    "merge_reference",
    "nonzeros_allreduce",
    "partition_bounds",
    "plan_leaves",
    "qsgd_dequantize",
    "qsgd_dequantize_reference",
    "qsgd_quantize",
    "qsgd_quantize_reference",
    "qsgd_wire_bytes",
    "reduce_streams",
    "reset_after_error",
    "scatter_add",
    "scatter_add_reference",
    "sparse_allgather",
    "sparse_allreduce",
    "sparse_allreduce_start",
    "sparse_allreduce_wait",
    "sparsifiers",
    "sparsify",
    "split",
    "split_reference",
    "topk",
    "topk_reference",
    "unfuse_leaves",
]
