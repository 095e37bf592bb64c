"""sparcml_jax: SparCML sparse and low-precision gradient communication for JAX."""
from sparcml_jax.stream import SparseStream, dense_threshold
from sparcml_jax.kernels.merge import merge, merge_reference

__all__ = ["SparseStream", "dense_threshold", "merge", "merge_reference"]
