"""Sparse updates: optimizer steps that touch only the coordinates a gradient stream holds.

A naturally sparse model (SparCML §8.2: logistic regression on URL's 3.2M sparse features;
embeddings) touches a few thousand of its millions of parameters per step. When its gradient
arrives as a :class:`SparseStream` (:func:`sparcml_jax.coalesce`, reduced by
:func:`sparcml_jax.allreduce_gradients`), :func:`lazy` runs an optax transformation on the
stream's support only and :func:`apply_updates` adds the result there, so the step costs
O(nnz) instead of several passes over every parameter.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from sparcml_jax.kernels._common import valid_mask
from sparcml_jax.kernels.partition import scatter_add
from sparcml_jax.stream import VALUE_DTYPE, SparseStream, with_indices


def _is_stream(x: Any) -> bool:
    return isinstance(x, SparseStream)


def lazy(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """``inner`` applied, for each :class:`SparseStream` update leaf, to the coordinates it holds.

    For a stream leaf with support ``S`` the parameters, updates and every state leaf that mirrors
    the parameter (``optax.adagrad``'s sum of squares, ``optax.adam``'s moments) are gathered at
    ``S``, ``inner.update`` runs on those vectors, the state is scattered back, and the update
    leaf is the stream of the new values on ``S``. Dense leaves go through ``inner`` unchanged.

    This is exact (the same numbers as ``inner`` on the dense gradient) when ``inner`` is
    elementwise and a zero gradient leaves a coordinate's state and update at zero change:
    ``optax.sgd`` without momentum, ``optax.adagrad``. For transformations whose state decays
    at every step (momentum, ``optax.adam``, ``optax.rmsprop``) coordinates outside ``S`` keep
    their state until they are touched again: the "lazy" variants of TensorFlow's LazyAdam and
    PyTorch's SparseAdam. Step counters and other scalars advance once per step as usual.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> import sparcml_jax
      >>> params = {"w": jnp.ones(6)}
      >>> tx = sparcml_jax.lazy(optax.adagrad(0.1))
      >>> state = tx.init(params)
      >>> grad = {"w": sparcml_jax.coalesce(jnp.array([4, 1], jnp.int32), jnp.array([2.0, -1.0]), size=6)}
      >>> updates, state = tx.update(grad, state, params)
      >>> [round(v, 3) for v in sparcml_jax.apply_updates(params, updates)["w"].tolist()]
      [1.0, 1.095, 1.0, 1.0, 0.901, 1.0]
    """

    def init_fn(params):
        return inner.init(params)

    def update_fn(updates, state, params=None):
        leaves, treedef = jax.tree.flatten(updates, is_leaf=_is_stream)
        leaves = [with_indices(leaf) if _is_stream(leaf) else leaf for leaf in leaves]  # the support: every entry
        streams = {i: leaf for i, leaf in enumerate(leaves) if _is_stream(leaf)}
        if not streams:
            return inner.update(updates, state, params)
        positions = {i: jnp.where(valid_mask(s), s.indices, 0) for i, s in streams.items()}

        def mirrors(x):
            """Whether a state subtree holds one array per parameter (gathered and scattered on S)."""
            if jax.tree.structure(x) != treedef:
                return False
            x_leaves = jax.tree.leaves(x)
            return all(hasattr(x_leaves[i], "size") and x_leaves[i].size == s.size for i, s in streams.items())

        def gather(tree):
            tree_leaves = treedef.flatten_up_to(tree)
            return treedef.unflatten([jnp.ravel(leaf)[positions[i]] if i in streams else leaf
                                      for i, leaf in enumerate(tree_leaves)])

        def scatter(old, new):
            old_leaves, new_leaves = treedef.flatten_up_to(old), treedef.flatten_up_to(new)
            out = []
            for i, (o, n) in enumerate(zip(old_leaves, new_leaves)):
                if i in streams:
                    s = streams[i]
                    where = jnp.where(valid_mask(s), s.indices, s.size)
                    n = jnp.ravel(o).at[where].set(n.astype(o.dtype), mode="drop").reshape(o.shape)
                out.append(n)
            return treedef.unflatten(out)

        dense_updates = treedef.unflatten([jnp.where(valid_mask(leaf), leaf.values, 0.0) if i in streams else leaf
                                           for i, leaf in enumerate(leaves)])
        gathered_state = jax.tree.map(lambda x: gather(x) if mirrors(x) else x, state, is_leaf=mirrors)
        gathered_params = None if params is None else gather(params)
        new_updates, new_gathered_state = inner.update(dense_updates, gathered_state, gathered_params)
        new_state = jax.tree.map(lambda old, new: scatter(old, new) if mirrors(old) else new, state,
                                 new_gathered_state, is_leaf=mirrors)
        out = [SparseStream(s.indices, jnp.where(valid_mask(s), new, 0.0).astype(VALUE_DTYPE), s.nnz, s.size)
               if i in streams else new for i, (s, new) in
               enumerate(zip(leaves, treedef.flatten_up_to(new_updates)))]
        return treedef.unflatten(out), new_state

    return optax.GradientTransformation(init_fn, update_fn)


def apply_updates(params: Any, updates: Any) -> Any:
    """``optax.apply_updates`` for updates that may hold :class:`SparseStream` leaves.

    A stream leaf is added at its support only (in place when the parameters are donated to
    the jitted step); its size is the parameter's number of entries (row-major flattening).

    Example:
      >>> import jax.numpy as jnp
      >>> import sparcml_jax
      >>> step = sparcml_jax.coalesce(jnp.array([2], jnp.int32), jnp.array([0.5]), size=4)
      >>> sparcml_jax.apply_updates({"w": jnp.ones((2, 2))}, {"w": step})["w"].tolist()
      [[1.0, 1.0], [1.5, 1.0]]
    """

    def add(p, u):
        if not _is_stream(u):
            return optax.apply_updates(p, u)
        if u.size != jnp.size(p):
            raise ValueError(f"apply_updates: a SparseStream update of size {u.size} for a parameter of shape "
                             f"{jnp.shape(p)}; the stream must index the flattened parameter")
        flat = jnp.ravel(p).astype(VALUE_DTYPE)
        return scatter_add(u, flat).reshape(jnp.shape(p)).astype(jnp.result_type(p))

    return jax.tree.map(add, params, updates, is_leaf=_is_stream)
