"""The stages of sparse gradient communication, each an optax transformation of its own.

Between stages the updates are a pytree whose leaves are dense arrays or :class:`SparseStream`
streams (over the flattened leaf), or a :class:`sparcml_jax.transform.LeafGroups` (the fused
buffers of :func:`sparcml_jax.transform.fuse_leaves`). Every stage flattens with streams as
leaves, so no stage ever treats a stream's indices as updates. They sit in this order:

1. :func:`sparsify` turns dense leaves into streams (top-k, random-k, threshold, any callable);
   :func:`error_feedback` wraps it and keeps what was not sent;
2. :func:`reduce_streams` sums every rank's streams (and dense leaves) over MPI; in place of
   both steps, :func:`global_topk_reduce` sums dense buffers with a global top-k allreduce
   (SparDL, Ok-Topk, gTop-k), which selects inside the collective, and keeps the residual it returns;
3. :func:`densify` turns the reduced streams back into dense leaves of the parameters' shapes.

Any stage of your own may sit between them if it takes and returns such a pytree: a reduction
of your own in place of :func:`reduce_streams`, a sparsifier of your own inside
:func:`error_feedback`. :func:`sparcml_jax.allreduce_gradients` is these stages, chained.

Cookbook (each runs as one process, where every sum is this rank's own contribution):

A sparsifier of your own is a callable ``(v, k, key) -> SparseStream`` of at most ``k`` entries:

  >>> import jax, jax.numpy as jnp, optax
  >>> import sparcml_jax
  >>> def largest_values(v, k, key):  # the k largest values, not magnitudes
  ...     chosen = jnp.sort(jax.lax.top_k(v, k)[1]).astype(jnp.int32)
  ...     return sparcml_jax.gather(v, chosen, jnp.int32(k))
  >>> params = {"w": jnp.zeros(4)}
  >>> tx = sparcml_jax.allreduce_gradients(sparsifier=largest_values, k=1, min_size=0)
  >>> tx.update({"w": jnp.array([1.0, -5.0, 2.0, 0.0])}, tx.init(params))[0]["w"].tolist()
  [0.0, 0.0, 2.0, 0.0]

Error feedback alone, before a reduction of your own (here: densify, then whatever sums):

  >>> tx = optax.chain(sparcml_jax.error_feedback(sparcml_jax.sparsify(k=1)), sparcml_jax.densify())
  >>> state = tx.init(params)
  >>> sent, state = tx.update({"w": jnp.array([1.0, -5.0, 2.0, 0.0])}, state, params)
  >>> sent["w"].tolist(), state[0].residual["w"].tolist()
  ([0.0, -5.0, 0.0, 0.0], [1.0, 0.0, 2.0, 0.0])

A density per layer, and layers kept out of compression (exact sums of their nonzeros, as CGX
and DGC leave the first and last layers), with ``optax.partition``:

  >>> params = {"embed": jnp.zeros(1000), "head": jnp.zeros(10)}
  >>> tx = optax.partition({"sparse": sparcml_jax.allreduce_gradients(density=0.01, min_size=0),
  ...                       "exact": sparcml_jax.allreduce_gradients()},
  ...                      {"embed": "sparse", "head": "exact"})
  >>> state = tx.init(params)
  >>> grads = {"embed": jnp.ones(1000), "head": jnp.ones(10)}
  >>> updates, state = tx.update(grads, state, params)
  >>> int((updates["embed"] != 0).sum()), int((updates["head"] != 0).sum())
  (10, 10)

Logging the stats, wherever they sit in the optimizer state:

  >>> stats = optax.tree_utils.tree_get(state.inner_states["sparse"], "stats")
  >>> float(stats.density), int(stats.algorithm) >= -1
  (0.009999999776482582, True)
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any, Hashable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from mpi4py import MPI

from sparcml_jax.collectives import ALGORITHMS, CostModel, dense_allreduce, nonzeros_allreduce, sparse_allreduce
from sparcml_jax.collectives._plan import GLOBAL_TOPK_ALGORITHMS
from sparcml_jax.collectives.global_topk import OktopkState, global_topk_allreduce, init_oktopk_state
from sparcml_jax.collectives.global_topk import check_options as check_global_topk_options
from sparcml_jax.collectives.nonblocking import sparse_allreduce_start, sparse_allreduce_wait
from sparcml_jax.collectives.group import Group, check_group
from sparcml_jax.collectives.validate import wire_bits
from sparcml_jax.comm._compat import varying_axes
from sparcml_jax.kernels._common import cond_varying
from sparcml_jax.kernels.partition import (from_dense, from_dense_counted, pack, scatter_add, to_dense_parts,
                                           unpack)
from sparcml_jax import sparsifiers
from sparcml_jax.sparsifiers import Sparsifier, resolve
from sparcml_jax.stream import VALUE_DTYPE, SparseStream, append_dense, dense_stream, resize, with_indices

SENT_DENSE = -1  # GradientStats.algorithm when the largest buffer travelled dense


class GradientStats(collections.namedtuple("GradientStats", ["values"])):
    """What the last update did, for logging: one float32 vector in the state, read through the
    properties (a step that communicates pays JAX's dispatch for every state leaf, about 30 us
    each way on a 2-core VM; BENCHMARKS.md). Build it from the three numbers.

    Attributes:
      values: float32 ``[density, bytes_sent, algorithm]`` (stacked in front by ``vmap``).
      density: float32 nonzeros of the reduced buffers over their length.
      bytes_sent: float32 payload bytes this rank sent in the last update.
      algorithm: int32 index into ``sparcml_jax.ALGORITHMS + sparcml_jax.GLOBAL_TOPK_ALGORITHMS``
        of the largest buffer's algorithm (-1 when it travelled dense: during warm-up, or when a
        rank exceeded ``capacity``).

    Example:
      >>> import sparcml_jax
      >>> stats = sparcml_jax.GradientStats(0.25, 1024.0, 2)
      >>> float(stats.density), float(stats.bytes_sent), int(stats.algorithm)
      (0.25, 1024.0, 2)
    """

    __slots__ = ()

    def __new__(cls, *args: Any, **numbers: Any) -> "GradientStats":
        if "values" in numbers or (len(args) == 1 and not numbers):  # the packed vector: unflattening
            return super().__new__(cls, *args, **numbers)  # (whatever the leaf), unpickling, msgpack
        # Three numbers: a new record, or one pickled when they were three fields.
        numbers = dict(zip(("density", "bytes_sent", "algorithm"), args), **numbers)
        if len(args) > 3 or sorted(numbers) != ["algorithm", "bytes_sent", "density"]:
            raise TypeError(f"GradientStats takes density, bytes_sent and algorithm (or values=, the packed "
                            f"vector), got {sorted(numbers)}")
        return super().__new__(cls, jnp.stack([jnp.asarray(numbers[name], jnp.float32)
                                               for name in ("density", "bytes_sent", "algorithm")], axis=-1))

    def _replace(self, **changes: Any) -> "GradientStats":
        if set(changes) == {"values"}:
            return GradientStats(values=changes["values"])
        numbers = dict(density=self.density, bytes_sent=self.bytes_sent, algorithm=self.algorithm)
        unknown = set(changes) - set(numbers)
        if unknown:
            raise ValueError(f"GradientStats has no field {sorted(unknown)}; it has density, bytes_sent, algorithm")
        return GradientStats(**{**numbers, **changes})

    @property
    def density(self) -> jax.Array:
        return self.values[..., 0]

    @property
    def bytes_sent(self) -> jax.Array:
        return self.values[..., 1]

    @property
    def algorithm(self) -> jax.Array:
        return self.values[..., 2].astype(jnp.int32)


class SparsifyState(NamedTuple):
    """:func:`sparsify`'s step count, kept with warm-up, and PRNG key data, kept unless the
    sparsifier is ``"topk"`` (which draws nothing); each ``()`` when not kept: a step with MPI
    calls takes JAX's Python dispatch path, which handles every state leaf one by one."""

    count: jax.Array | tuple
    key: jax.Array | tuple


class ErrorFeedbackState(NamedTuple):
    """:func:`error_feedback`'s residual (float32, like the updates) and its sparsifier's state."""

    residual: Any
    inner: Any


class ReduceState(NamedTuple):
    """:func:`reduce_streams`'s step count (kept with warm-up or an array ``warmup_steps``, else
    ``()``), PRNG key data (kept with QSGD, else ``()``), the last update's stats and, with
    ``quantize_feedback``, what QSGD's split phase lost on this rank per fused buffer (float32,
    added to the next update's buffers)."""

    count: jax.Array | tuple
    key: jax.Array | tuple
    stats: GradientStats
    quantization_error: tuple = ()


def is_stream(x: Any) -> bool:
    return isinstance(x, SparseStream)


def sparsify(sparsifier: str | Sparsifier = "topk", *, density: float | None = None, k: int | None = None,
             warmup_steps: int | jax.Array = 0, seed: int = 0) -> optax.GradientTransformation:
    """Replaces every dense leaf ``v`` by the stream of its selected entries (SparCML §5).

    A leaf of ``n`` entries keeps ``ceil(density * n)`` of them, or its share of ``k``,
    ``round(k * n / N)`` with ``N`` the dense leaves' total, so that the leaves send about ``k``
    entries in all. Stream leaves pass unchanged. Leaf ``g`` (in flattening order) draws its
    random choices from ``fold_in(split(key)[1], g)``.

    Args:
      sparsifier: ``"topk"``, ``"randomk"``, ``sparcml_jax.sparsifiers.threshold(tau)`` or any
        callable ``(v, k, key) -> SparseStream`` returning at most ``k`` entries of ``v``.
      density: fraction of each leaf's entries to keep, in (0, 1].
      k: entries to keep in all, instead of ``density``.
      warmup_steps: for the first steps every leaf is sent whole (its dense stream). Streams
        then have capacity ``n`` at every step.
      seed: seeds the PRNG key of the state.

    Example:
      >>> import jax.numpy as jnp
      >>> import sparcml_jax
      >>> tx = sparcml_jax.sparsify(k=2)
      >>> streams, _ = tx.update({"w": jnp.array([0.5, -3.0, 1.0, 2.0])}, tx.init(None))
      >>> streams["w"].indices.tolist(), streams["w"].values.tolist()
      ([1, 3], [-3.0, 2.0])
    """
    check_budget(density, k)
    if density is None and k is None:
        raise ValueError("sparsify needs density or k (how many entries to keep)")
    check_warmup(warmup_steps)
    select = resolve(sparsifier)

    draws = select is not sparsifiers.topk  # the only sparsifier known to ignore its key

    def init_fn(params):
        del params
        return SparsifyState(initial_count(warmup_steps), initial_key(seed) if draws else ())

    def update_fn(updates, state, params=None):
        del params
        leaves, treedef = jax.tree.flatten(updates, is_leaf=is_stream)
        dense = [i for i, leaf in enumerate(leaves) if not is_stream(leaf)]
        total = sum(jnp.size(leaves[i]) for i in dense)
        key, step_key = jax.random.split(jax.random.wrap_key_data(state.key)) if draws else ((), None)
        warming = warming_up(state.count, warmup_steps)
        out = list(leaves)
        for g, i in enumerate(dense):
            v = jnp.ravel(jnp.asarray(leaves[i], VALUE_DTYPE))
            stream = select(v, leaf_budget(v.shape[0], total, density, k),
                            jax.random.fold_in(step_key, g) if draws else None)
            if warming is not None:
                stream = cond_varying(warming, lambda v=v: with_indices(dense_stream(v)), lambda s=stream, n=v.shape[0]: resize(s, n),
                                      axes=varying_axes(v))
            out[i] = stream
        return jax.tree.unflatten(treedef, out), SparsifyState(next_count(state.count), jax.random.key_data(key)
                                                               if draws else ())

    return optax.GradientTransformation(init_fn, update_fn)


def error_feedback(sparsifier: optax.GradientTransformation) -> optax.GradientTransformation:
    """Keeps what ``sparsifier`` did not send and adds it to the next update (SparCML §2, §6).

    Rank ``i`` keeps a residual ``r_i``: at step ``t`` it forms ``a_i = g_i + r_i``, sends
    ``s_i = sparsifier(a_i)`` and keeps ``r_i <- a_i - s_i``, so that over any number of steps
    everything sent plus the residual is the sum of all gradients (Strom 2015; Seide et al.
    2014). ``sparsifier`` maps dense leaves to streams over the flattened leaf (or to a
    :class:`~sparcml_jax.transform.LeafGroups`); stream leaves of the gradient pass unchanged.

    Example:
      >>> import jax.numpy as jnp
      >>> import sparcml_jax
      >>> tx = sparcml_jax.error_feedback(sparcml_jax.sparsify(k=1))
      >>> state = tx.init({"w": jnp.zeros(3)})
      >>> sent, state = tx.update({"w": jnp.array([1.0, -2.0, 0.5])}, state)
      >>> sent["w"].to_dense().tolist(), state.residual["w"].tolist()
      ([0.0, -2.0, 0.0], [1.0, 0.0, 0.5])
    """

    def init_fn(params):
        residual = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), VALUE_DTYPE), params)
        return ErrorFeedbackState(residual, sparsifier.init(params))

    def update_fn(updates, state, params=None):
        leaves, treedef = jax.tree.flatten(updates, is_leaf=is_stream)
        residual, residual_def = jax.tree.flatten(state.residual)
        check_like_residual("error_feedback", leaves, treedef, residual, residual_def)
        accumulated = [g if is_stream(g) else jnp.asarray(g, VALUE_DTYPE) + r for g, r in zip(leaves, residual)]
        sent, inner_state = sparsifier.update(jax.tree.unflatten(treedef, accumulated), state.inner, params)
        new_residual = [r if is_stream(a) else not_sent(a, s)
                        for a, r, s in zip(accumulated, residual, sent_leaves(sent))]
        return sent, ErrorFeedbackState(jax.tree.unflatten(residual_def, new_residual), inner_state)

    return optax.GradientTransformation(init_fn, update_fn)


class FusedBuffers(NamedTuple):
    """What :func:`~sparcml_jax.fuse_leaves`'s ``inner`` transformation sees and returns: one flat
    buffer (or the stream a sparsifier made of it) per group of :func:`~sparcml_jax.plan_leaves`,
    in the plan's order. The residuals of an inner :func:`error_feedback` and of
    :func:`global_topk_reduce` are kept in this container, so that the state says which layout it
    holds; :func:`~sparcml_jax.unfuse_leaves` cuts it into the parameters' leaves.
    """

    buffers: tuple


def leaf_sizes(leaves: list) -> list[int]:
    """Entries of each leaf (a stream's: its size)."""
    return [x.size if is_stream(x) else math.prod(jnp.shape(x)) for x in leaves]


def relaid(buffers: tuple, groups: tuple, to_groups: tuple, sizes: list[int], into: tuple | None = None) -> tuple:
    """Buffers laid out by ``groups`` (leaf indices, each leaf ``sizes[i]`` entries in a row), laid
    out by ``to_groups``; a leaf in none of ``groups`` keeps its segment of ``into`` (else zeros)."""
    where = {}
    for b, group in enumerate(groups):
        offset = 0
        for i in group:
            where[i] = (b, offset)
            offset += sizes[i]
    out = []
    for t, group in enumerate(to_groups):
        laid, offset = into[t] if into is not None else jnp.zeros((sum(sizes[i] for i in group),), VALUE_DTYPE), 0
        for i in group:
            if i in where:
                b, start = where[i]
                laid = jax.lax.dynamic_update_slice(laid, buffers[b][start:start + sizes[i]], (offset,))
            offset += sizes[i]
        out.append(laid)
    return tuple(out)


def check_fused_residual(stage: str, residual: Any, shapes: list[tuple[int]]) -> None:
    """``residual`` is the :class:`FusedBuffers` that init made for fused buffers of ``shapes``."""
    held = [jnp.shape(r) for r in jax.tree.leaves(residual)]
    if not isinstance(residual, FusedBuffers) or held != shapes:
        raise ValueError(f"{stage}: the gradient's fused buffers have shapes {shapes}, but the residual that init "
                         f"made holds {held}; re-run init with the parameters you train")


def check_like_residual(stage: str, leaves: list, treedef: Any, residual: list, residual_def: Any) -> None:
    """The gradient has the pytree and leaf shapes of the residual that init made."""
    if treedef != residual_def:
        raise ValueError(f"{stage}: the gradient pytree differs from the one given to init "
                         f"(init: {residual_def}, update: {treedef}); re-run init with the parameters you train")
    check_leaf_shapes(stage, leaves, residual, "init saw", "re-run init with the parameters you train")


def check_leaf_shapes(stage: str, leaves: list, like: list, saw: str, fix: str) -> None:
    """Each gradient leaf has the shape of its counterpart in ``like`` (a stream leaf: its size)."""
    for i, (leaf, other) in enumerate(zip(leaves, like)):
        if (leaf.size if is_stream(leaf) else jnp.shape(leaf)) != (
                math.prod(jnp.shape(other)) if is_stream(leaf) else jnp.shape(other)):
            shape = f"a SparseStream of size {leaf.size}" if is_stream(leaf) else f"shape {jnp.shape(leaf)}"
            raise ValueError(f"{stage}: gradient leaf {i} has {shape} but {saw} {jnp.shape(other)}; {fix}")


def sent_leaves(sent: Any) -> list:
    """A sparsifier's output, one stream or dense array per leaf of its input."""
    if hasattr(sent, "unpack"):  # LeafGroups: fused buffers back to their leaves
        return sent.unpack(cast=False)
    return jax.tree.leaves(sent, is_leaf=is_stream)


def not_sent(accumulated: jax.Array, sent: Any) -> jax.Array:
    """``accumulated - sent``: for a stream, its pairs scattered with their signs flipped into
    ``accumulated`` in place (a selected entry becomes exactly 0), without densifying it."""
    if not is_stream(sent):
        return accumulated - sent
    flat = jnp.ravel(accumulated)
    negated = dataclasses.replace(sent, values=-sent.values)
    return scatter_add(negated, flat).reshape(jnp.shape(accumulated))


def reduce_streams(*, algorithm: str = "auto", transport: str | None = None, comm: MPI.Comm | None = None,
                   axis_name: Hashable | None = None, average: bool = True, quantize_bits: int | None = None, delta: float = 1.0,
                   bucket_size: int = 1024, quantize_scale: str = "max", cost_model: CostModel | None = None,
                   capacity: int | None = None, warmup_steps: int | jax.Array = 0, nonblocking: bool = False,
                   seed: int = 0, quantize_feedback: bool = False,
                   value_dtype: Any = None) -> optax.GradientTransformation:
    """Sums (or averages) the updates of every rank of ``comm`` (SparCML §4, §6, §7).

    Stream leaves are summed by :func:`sparcml_jax.sparse_allreduce` (``algorithm``,
    ``transport``, QSGD with ``quantize_bits`` on DSAR's dense phase, keyed per buffer like
    :func:`sparsify`); dense leaves travel in one dense allreduce. Of a
    :class:`~sparcml_jax.transform.LeafGroups`, the fused buffers travel as streams (a dense
    buffer is sent as its nonzeros, exactly, by :func:`sparcml_jax.nonzeros_allreduce`; with
    ``capacity`` at most that many of them, or dense when any rank has more or during warm-up),
    the small leaves' entries appended whole to the first one, so that one collective carries
    both; the streams the gradient brought are summed exactly, without QSGD. The small leaves
    take a dense allreduce of their own with ``capacity``, ``nonblocking`` and
    ``quantize_feedback``, and when the first buffer is bfloat16 and they are not. The averaged
    result is ``sum_i s_i / P``.

    Args:
      algorithm, transport, delta, bucket_size, quantize_scale, cost_model: passed to
        :func:`sparcml_jax.sparse_allreduce`.
      comm: mpi4py communicator; ``None`` is mpi4jax's default (a clone of COMM_WORLD).
      axis_name: instead of ``comm``: sum over this mesh axis, inside ``jax.shard_map``.
      average: divide the sum by the number of ranks.
      quantize_bits: QSGD bits (2, 4, 8) wherever DSAR's phases carry dense values (see
        :func:`sparcml_jax.sparse_allreduce`).
      quantize_feedback: error feedback for QSGD's split phase (EF-SGD): each dense fused
        buffer travels as ``x + e``, and ``e`` becomes what the split phase's coding lost on
        this rank (:func:`sparcml_jax.sparse_allreduce`'s ``quantize_feedback``), kept in the
        state's ``quantization_error``. Its ``init`` takes the packed parameters
        (:class:`~sparcml_jax.transform.LeafGroups`) to size it. The allgather phase's error is
        the same on every rank and left to QSGD's unbiasedness.
      value_dtype: ``jnp.bfloat16``: the streams' values travel as bfloat16 (see
        :func:`sparcml_jax.sparse_allreduce`).
      capacity: a bound on the nonzeros of a rank's dense fused buffer (see above).
      warmup_steps: steps during which dense fused buffers travel dense; the stats then report
        algorithm -1 (pair with :func:`sparsify`'s ``warmup_steps``).
      nonblocking: start every stream's reduction on the non-blocking engine
        (:func:`sparcml_jax.sparse_allreduce_start`) before waiting for any, so that the engine
        reduces one buffer while the program prepares the next. Native transport, no capacity.
      seed: seeds the PRNG key of the state.

    Example (one process: the sum is what this rank sent):
      >>> import jax.numpy as jnp
      >>> import sparcml_jax
      >>> tx = sparcml_jax.reduce_streams(algorithm="ssar_recursive_doubling")
      >>> grads = {"w": sparcml_jax.topk(jnp.array([0.5, -3.0, 1.0]), 1), "b": jnp.ones(2)}
      >>> total, state = tx.update(grads, tx.init(None))
      >>> total["w"].to_dense().tolist(), total["b"].tolist(), float(state.stats.density)
      ([0.0, -3.0, 0.0], [1.0, 1.0], 0.3333333432674408)
    """
    if quantize_bits is not None and quantize_bits not in (2, 4, 8):
        raise ValueError(f"quantize_bits must be 2, 4, 8 or None, got {quantize_bits!r}")
    if quantize_bits is not None and algorithm not in ("auto", "dsar_split_allgather"):
        raise ValueError(f"quantize_bits needs algorithm 'auto' or 'dsar_split_allgather', got {algorithm!r}")
    if value_dtype is not None and nonblocking:
        raise ValueError(f"value_dtype={value_dtype!r} runs blocking reductions: drop buckets (nonblocking)")
    if value_dtype is not None:
        wire_bits(value_dtype)
    if quantize_feedback and (quantize_bits is None or nonblocking):
        raise ValueError("quantize_feedback feeds back QSGD's split-phase error: it needs quantize_bits and a "
                         f"blocking reduction (got quantize_bits={quantize_bits!r}, nonblocking={nonblocking!r})")
    if algorithm != "auto" and algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be 'auto' or one of {ALGORITHMS}, got {algorithm!r}")
    check_group(comm, axis_name, transport)
    check_warmup(warmup_steps)
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1):
        raise ValueError(f"capacity must be a positive int or None, got {capacity!r}")
    if nonblocking and (transport not in (None, "native") or capacity is not None or axis_name is not None):
        raise ValueError("nonblocking reductions run on the non-blocking engine: it needs transport='native' over "
                         f"MPI and does not support capacity (got transport={transport!r}, capacity={capacity!r}, "
                         f"axis_name={axis_name!r})")
    collective = dict(algorithm=algorithm, transport=transport, delta=delta, bucket_size=bucket_size,
                      quantize_scale=quantize_scale, cost_model=cost_model)

    def init_fn(params):
        stats = GradientStats(0, 0, SENT_DENSE)
        errors = ()
        if quantize_feedback:
            if not hasattr(params, "parts"):
                raise TypeError("reduce_streams(quantize_feedback=True).init takes the packed parameters (LeafGroups, "
                                "as fuse_leaves(...).update(params, ...) makes them), to size the error of each buffer")
            errors = tuple(jnp.zeros((x.shape[0],), VALUE_DTYPE) for x in params.fused)
        key = () if quantize_bits is None else initial_key(seed)
        return ReduceState(initial_count(warmup_steps), key, stats, errors)

    def update_fn(updates, state, params=None):
        del params
        group = Group.of(comm, axis_name)
        nprocs = group.size
        dense, fused, given = updates.parts() if hasattr(updates, "parts") else _parts(updates)
        if quantize_bits is None:  # no QSGD: no key to draw
            key, keys = state.key, [None] * len(fused)
        else:
            key, step_key = jax.random.split(jax.random.wrap_key_data(state.key))
            key, keys = jax.random.key_data(key), [jax.random.fold_in(step_key, g) for g in range(len(fused))]
        warming = warming_up(state.count, warmup_steps)
        if quantize_feedback:
            if any(is_stream(x) for x in fused):
                raise TypeError("quantize_feedback adds QSGD's split-phase error to dense buffers; these were "
                                "sparsified (top-k segments travel as exact pairs: leave quantize_feedback off)")
            fused = [x + e for x, e in zip(fused, state.quantization_error)]
        pending = [_prepare(x, warming, capacity, group, nonblocking) for x in fused]
        fused = [x.astype(VALUE_DTYPE) if stream is not None and not is_stream(x) else x
                 for x, (stream, _) in zip(fused, pending)]
        sizes = [x.size if is_stream(x) else x.shape[0] for x in fused] + [s.size for s in given]
        carried = hasattr(updates, "parts") and _carries_small(dense, fused, pending, nonblocking, quantize_feedback)
        if carried:
            fused[0], pending[0] = _with_small(fused[0], pending[0][0], dense)
            sizes[0] += sum(jnp.size(x) for x in dense)
            reduced_dense = []
        else:
            reduced_dense = dense_sum(dense, group, average)
        on_group = dict(collective, transport=group.transport(transport))
        on_group = dict(on_group, value_dtype=value_dtype) if value_dtype is not None else on_group
        options = [dict(on_group, quantize_bits=quantize_bits, key=k, quantize_feedback=quantize_feedback)
                   for k in keys] + [dict(on_group, quantize_bits=None)] * len(given)
        streams = [stream for stream, _ in pending] + list(given)
        send_dense = [dense_when for _, dense_when in pending] + [None] * len(given)
        vectors = list(fused) + [None] * len(given)
        if nonblocking:
            blocking_only = ("transport", "quantize_feedback")
            handles = [sparse_allreduce_start(s, comm=group.comm, **{n: v for n, v in o.items() if n not in blocking_only})
                       for s, o in zip(streams, options)]
            results = [(_averaged(total, nprocs, average), stats, None)
                       for total, stats in (sparse_allreduce_wait(h, return_stats=True) for h in handles)]
            errors = ()
        else:
            reduced = [_reduce_one(s, v, when, group, o, average)
                       for s, v, when, o in zip(streams, vectors, send_dense, options)]
            results = [r[:3] for r in reduced]
            errors = tuple(r[3] for r in reduced[:len(fused)]) if quantize_feedback else ()
        out = [r for r, _, _ in results]
        if carried:
            out[0], reduced_dense = _without_small(out[0], dense)
        stats = _stats(sizes, results, len(fused), warming)
        new_state = ReduceState(next_count(state.count), key, stats, errors)
        rebuilt = updates.replace_parts(reduced_dense, out[:len(fused)], out[len(fused):]) \
            if hasattr(updates, "parts") else _replace_parts(updates, reduced_dense, out)
        return rebuilt, new_state

    return optax.GradientTransformation(init_fn, update_fn)


def _parts(tree: Any) -> tuple[list, list, list]:
    """An ordinary pytree's dense leaves (sent dense) and stream leaves (reduced as streams)."""
    leaves = jax.tree.leaves(tree, is_leaf=is_stream)
    return [x for x in leaves if not is_stream(x)], [x for x in leaves if is_stream(x)], []


def _carries_small(dense: list, fused: list, pending: list, nonblocking: bool, quantize_feedback: bool) -> bool:
    """Whether the small leaves ride in the first fused buffer's collective (one collective per
    step instead of two). They travel in a dense allreduce of their own on the non-blocking engine,
    with ``quantize_feedback`` (whose error is sized by the buffers), when the exact mode's
    ``capacity`` may send the buffer dense instead, and when a bfloat16 buffer would round float32
    leaves."""
    if not dense or not fused or nonblocking or quantize_feedback or pending[0][1] is not None:
        return False
    vector = fused[0]
    return pending[0][0] is not None or vector.dtype == VALUE_DTYPE or all(
        jnp.result_type(x) == vector.dtype for x in dense)


def _with_small(vector: Any, stream: SparseStream | None, dense: list) -> tuple[Any, tuple]:
    """The first fused buffer (and its stream) with every entry of the small leaves after its own."""
    if stream is None:
        return join_flat([vector, *dense], vector.dtype), (None, None)
    return vector, (append_dense(stream, join_flat(dense, VALUE_DTYPE)), None)


def _without_small(total: Any, dense: list) -> tuple[jax.Array, list]:
    """The first fused buffer's sum (dense: its leaves are densified next) and the small leaves'."""
    size, dtype = (total.size, VALUE_DTYPE) if is_stream(total) else (total.shape[0], total.dtype)
    first, *small = split_like(total, [((size - sum(jnp.size(x) for x in dense),), dtype), *shapes_and_dtypes(dense)])
    return first, small


def _replace_parts(tree: Any, dense: list, streams: list) -> Any:
    leaves, treedef = jax.tree.flatten(tree, is_leaf=is_stream)
    dense, streams = iter(dense), iter(streams)
    return jax.tree.unflatten(treedef, [next(streams) if is_stream(x) else next(dense) for x in leaves])


def dense_sum(leaves: list, group: Group, average: bool) -> list:
    """The dense leaves summed in one dense allreduce, back in their shapes and dtypes."""
    if not leaves:
        return []
    flat = join_flat(leaves, VALUE_DTYPE)
    nprocs = group.size
    if nprocs > 1:
        flat = dense_allreduce(flat, **group.where)
        flat = flat / nprocs if average else flat
    return split_like(flat, shapes_and_dtypes(leaves))


def join_flat(leaves: list, dtype: Any) -> jax.Array:
    """The leaves raveled and concatenated into one ``dtype`` vector (:func:`split_like` cuts it back)."""
    return pack([jnp.ravel(jnp.asarray(x, dtype)) for x in leaves])


def shapes_and_dtypes(leaves: list) -> list[tuple[tuple[int, ...], Any]]:
    return [(jnp.shape(x), jnp.result_type(x)) for x in leaves]


def split_like(flat: Any, like: list[tuple[tuple[int, ...], Any]]) -> list:
    """``flat`` (a vector, or a stream of one) cut into consecutive pieces of the (shape, dtype)
    pairs ``like``, each reshaped and cast."""
    sizes = [math.prod(shape) for shape, _ in like]
    pieces = to_dense_parts(flat, sizes) if is_stream(flat) else unpack(flat, sizes)
    return [piece.reshape(shape).astype(dtype) for piece, (shape, dtype) in zip(pieces, like)]


def _prepare(x: Any, warming: jax.Array | None, capacity: int | None, group: Group, nonblocking: bool):
    """The stream a fused buffer travels as, and when (if ever) it travels dense instead; None
    for a buffer whose nonzeros the collective finds itself (:func:`nonzeros_allreduce`, which
    alone takes a bfloat16 buffer as it is)."""
    if is_stream(x):
        return x, None
    n = x.shape[0]
    if capacity is None and warming is None and not nonblocking:
        return None, None
    x = x.astype(VALUE_DTYPE)
    if capacity is not None and capacity < n:
        stream, count = from_dense_counted(x, capacity)
        too_many = group.max(count) > capacity
        return stream, too_many if warming is None else too_many | warming
    stream = from_dense(x, capacity=n)
    if warming is not None:
        stream = group.cond(warming, lambda: with_indices(dense_stream(x)), lambda: stream)
    return stream, None


def _reduce_one(stream: SparseStream, vector: jax.Array | None, send_dense: jax.Array | None, group: Group,
                options: dict, average: bool) -> tuple[Any, Any, jax.Array | None, jax.Array | None]:
    """(sum, or mean with ``average``; its AllreduceStats; whether it went dense; the split
    phase's coding error with ``quantize_feedback`` else None); with ``send_dense`` the sum is dense."""
    feedback = options.get("quantize_feedback", False)

    def with_error(out):  # (sum, [error,] stats) -> (sum, stats, error)
        return (out[0], out[-1], out[1] if feedback else None)

    if stream is None:  # (a bfloat16 mean is rounded once, from the float32 one)
        total, stats, error = with_error(nonzeros_allreduce(vector, **group.where, average=average,
                                                            return_stats=True, **options))
        return total, stats, None, error
    if send_dense is None:
        total, stats, error = with_error(sparse_allreduce(stream, **group.where, return_stats=True, **options))
        return _averaged(total, group.size, average), stats, None, error
    nprocs, n = group.size, vector.shape[0]

    def dense_path():
        sent = jnp.float32(2 * (nprocs - 1) / nprocs * 4 * n)
        error = jnp.zeros((n,), VALUE_DTYPE) if feedback else None  # (float32: nothing lost)
        return dense_allreduce(vector, **group.where), jnp.float32(n), sent, jnp.int32(SENT_DENSE), error

    def sparse_path():
        reduced, stats, error = with_error(sparse_allreduce(stream, **group.where, return_stats=True, **options))
        return reduced.to_dense(), stats.result_nnz.astype(jnp.float32), stats.bytes_sent, stats.algorithm, error

    total, nnz, sent, code, error = group.cond(send_dense, dense_path, sparse_path)
    return _averaged(total, nprocs, average), _Counted(nnz, sent, code), send_dense, error


class _Counted(NamedTuple):
    result_nnz: jax.Array
    bytes_sent: jax.Array
    algorithm: jax.Array


def _averaged(reduced: Any, nprocs: int, average: bool) -> Any:
    if not average:
        return reduced
    if is_stream(reduced):  # dividing the nnz values is cheaper than a pass over the dense result
        return dataclasses.replace(reduced, values=reduced.values / nprocs)
    return reduced / nprocs


def _stats(sizes: list[int], results: list, fused: int, warming: jax.Array | None) -> GradientStats:
    """Nonzeros and bytes of every buffer (of these sizes); the algorithm of the largest fused
    buffer (else stream)."""
    if not sizes:
        return GradientStats(0, 0, SENT_DENSE)
    nnz = sum(stats.result_nnz.astype(jnp.float32) for _, stats, _ in results)
    sent = sum(stats.bytes_sent for _, stats, _ in results)
    candidates = range(fused) if fused else range(len(sizes))
    largest = max(candidates, key=lambda i: sizes[i])
    code = results[largest][1].algorithm
    if warming is not None:
        code = jnp.where(warming, SENT_DENSE, code)
    return GradientStats(nnz / max(sum(sizes), 1), sent, code)


class GlobalTopkState(NamedTuple):
    """:func:`global_topk_reduce`'s state.

    Attributes:
      residual: what this rank holds back, a :class:`FusedBuffers` of one float32 vector per
        buffer that the packer makes of the parameters (``None`` without error feedback).
      inner: the packer's state.
      count: int32 steps taken (for warm-up).
      stats: the last update's :class:`GradientStats`.
      oktopk: Ok-Topk's thresholds and region boundaries, one :class:`OktopkState` per fused
        buffer, carried from step to step; empty for SparDL and gTop-k.
    """

    residual: Any
    inner: Any
    count: jax.Array
    stats: GradientStats
    oktopk: tuple[OktopkState, ...]


def global_topk_reduce(inner: optax.GradientTransformation | None = None, *, algorithm: str = "spardl",
                       density: float | None = None, k: int | None = None, error_feedback: bool = True,
                       transport: str | None = None, comm: MPI.Comm | None = None,
                       axis_name: Hashable | None = None, average: bool = True,
                       delta: float = 1.0, warmup_steps: int | jax.Array = 0, teams: int = 1,
                       tau: int = 128, tau_prime: int = 64) -> optax.GradientTransformation:
    r"""Error feedback around a global top-k allreduce (SparDL, Ok-Topk, gTop-k), in one stage.

    Rank :math:`r` packs its gradient with ``inner`` (typically :func:`~sparcml_jax.fuse_leaves`),
    forms :math:`a_r = g_r + e_r` on every fused buffer (gradient plus residual) and sums it with
    :func:`sparcml_jax.global_topk_allreduce`, which selects about ``k`` entries of
    :math:`\sum_r a_r` inside the collective and hands back as :math:`e_r'` what rank :math:`r`
    gave and the result does not hold:

    .. math::  \mathrm{total} + \sum_r e_r' = \sum_r a_r

    so everything applied plus every residual is the sum of all gradients, and the result keeps
    about ``k`` entries whatever the number of ranks (SparCML's sum of local top-k grows towards
    P k). No local top-k precedes it: the collective selects. A buffer of ``n`` entries gets
    ``k = ceil(density * n)``, or its share of ``k`` as in :func:`sparsify`. Ok-Topk's
    thresholds and region boundaries, estimated from step to step, live in the state
    (``optax.tree_utils.tree_get(state, "oktopk")``). Small leaves travel in one dense allreduce
    and stream leaves of the gradient are summed exactly, as in :func:`reduce_streams`. Follow
    with :func:`densify`.

    The stats count the result's nonzeros and the bytes sent; their ``algorithm`` indexes
    ``sparcml_jax.ALGORITHMS + sparcml_jax.GLOBAL_TOPK_ALGORITHMS``. What the collective returned
    to this rank is the residual itself, one vector per fused buffer (:class:`FusedBuffers`, in
    the layout of the parameters' buffers: :func:`~sparcml_jax.unfuse_leaves` cuts it into their
    leaves); small leaves and stream leaves are sent whole and hold nothing back. Gradient leaves
    that are streams leave their buffers, as in :func:`~sparcml_jax.fuse_leaves`, and their
    segments of the residual wait. A residual kept per parameter leaf (an older state) is packed
    into this layout on the next update.

    Args:
      inner: packs the accumulated gradient: :func:`~sparcml_jax.fuse_leaves`, or ``None``
        (every dense leaf is a buffer of its own).
      algorithm: one of ``sparcml_jax.GLOBAL_TOPK_ALGORITHMS``.
      density: the result's fraction of each buffer's entries, in (0, 1].
      k: the result's entries in all, instead of ``density``.
      error_feedback: keep the residual and add it to the next gradient (else it is dropped).
      transport, delta: passed to :func:`sparcml_jax.global_topk_allreduce`.
      comm: mpi4py communicator; ``None`` is mpi4jax's default (a clone of COMM_WORLD).
      axis_name: instead of ``comm``: sum over this mesh axis, inside ``jax.shard_map`` (call
        ``init`` there too for Ok-Topk, whose state depends on the axis size).
      average: divide the sum by the number of ranks.
      warmup_steps: for the first steps every buffer is summed dense and nothing is held back.
      teams: SparDL's teams G (must divide the number of ranks), passed to
        :func:`sparcml_jax.global_topk_allreduce`.
      tau, tau_prime: Ok-Topk's intervals, in steps, of exact thresholds and of re-balanced
        regions, passed to :func:`sparcml_jax.global_topk_allreduce`.

    Example (one process: the result is this rank's top k, the rest its residual):
      >>> import jax.numpy as jnp, optax
      >>> import sparcml_jax
      >>> tx = optax.chain(sparcml_jax.global_topk_reduce(sparcml_jax.fuse_leaves(min_size=0), k=2),
      ...                  sparcml_jax.densify())
      >>> params = {"w": jnp.zeros(4)}
      >>> state = tx.init(params)
      >>> sent, state = tx.update({"w": jnp.array([1.0, -5.0, 2.0, 0.5])}, state, params)
      >>> residual = optax.tree_utils.tree_get(state, "residual")
      >>> sent["w"].tolist(), sparcml_jax.unfuse_leaves(residual, params, min_size=0)["w"].tolist()
      ([0.0, -5.0, 2.0, 0.0], [1.0, 0.0, 0.0, 0.5])
    """
    if algorithm not in GLOBAL_TOPK_ALGORITHMS:
        raise ValueError(f"algorithm must be one of {GLOBAL_TOPK_ALGORITHMS}, got {algorithm!r}")
    check_budget(density, k)
    if density is None and k is None:
        raise ValueError(f"algorithm={algorithm!r} needs density or k (the size of the global result)")
    check_group(comm, axis_name, transport)
    check_warmup(warmup_steps)
    check_global_topk_options(algorithm, teams, tau, tau_prime)
    code = len(ALGORITHMS) + GLOBAL_TOPK_ALGORITHMS.index(algorithm)
    options = dict(algorithm=algorithm, transport=transport, delta=delta)
    collective_options = dict(options, teams=teams, tau=tau, tau_prime=tau_prime)

    def pack(tree, inner_state, params=None):
        return (tree, inner_state) if inner is None else inner.update(tree, inner_state, params)

    def budgets(fused) -> list[int]:
        total = sum(x.shape[0] for x in fused)
        return [leaf_budget(x.shape[0], total, density, k) for x in fused]

    def init_fn(params):
        inner_state = optax.EmptyState() if inner is None else inner.init(params)
        fused = jax.eval_shape(lambda p: _buffers(pack(p, inner_state)[0])[1], params)
        residual = FusedBuffers(tuple(jnp.zeros(x.shape, VALUE_DTYPE) for x in fused)) if error_feedback else None
        carried = ()
        if algorithm == "oktopk":
            nprocs = Group.of(comm, axis_name).size
            carried = tuple(init_oktopk_state(nprocs=nprocs) for _ in fused)
        stats = GradientStats(0, 0, SENT_DENSE)
        return GlobalTopkState(residual, inner_state, jnp.zeros((), jnp.int32), stats, carried)

    def layouts(updates, packed, inner_state) -> tuple[tuple, tuple, list[int]]:
        """The leaves of each fused buffer as init laid them out (every leaf dense) and as
        ``packed`` lays them out, and the leaves' sizes."""
        leaves = jax.tree.leaves(updates, is_leaf=is_stream)
        sizes = leaf_sizes(leaves)
        now = _layout(packed, leaves)
        if not any(is_stream(x) for x in leaves):
            return now, now, sizes
        treedef = jax.tree.structure(updates, is_leaf=is_stream)
        dense = jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct((x.size,), VALUE_DTYPE) if is_stream(x) else
                                             jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for x in leaves])
        at_init = jax.eval_shape(lambda t: pack(t, inner_state)[0], dense)
        return _layout(at_init, jax.tree.leaves(dense)), now, sizes

    def kept_residual(residual, updates, inner_state) -> FusedBuffers:
        """The state's residual as init laid it out, checked; one kept per leaf (an older state)
        is packed as the gradient is."""
        if not isinstance(residual, FusedBuffers):
            leaves, treedef = jax.tree.flatten(updates, is_leaf=is_stream)
            kept, kept_def = jax.tree.flatten(residual)
            check_like_residual("global_topk_reduce", leaves, treedef, kept, kept_def)
            residual = FusedBuffers(tuple(x.astype(VALUE_DTYPE) for x in _buffers(pack(residual, inner_state)[0])[1]))
        return residual

    def update_fn(updates, state, params=None):
        group = Group.of(comm, axis_name)
        nprocs = group.size
        on_group = dict(collective_options, transport=group.transport(transport))
        treedef = jax.tree.structure(updates, is_leaf=is_stream)
        packed, inner_state = pack(updates, state.inner, params)
        dense, fused, given = _buffers(packed)
        if error_feedback:
            kept = kept_residual(state.residual, updates, state.inner)
            at_init, now, sizes = layouts(updates, packed, state.inner)
            check_fused_residual("global_topk_reduce", kept, [(sum(sizes[i] for i in group),) for group in at_init])
            residual = kept.buffers if now == at_init else relaid(kept.buffers, at_init, now, sizes)
            fused = [x.astype(VALUE_DTYPE) + r for x, r in zip(fused, residual)]
        warming = warming_up(state.count, warmup_steps)
        summed = [_global_topk_sum(x.astype(VALUE_DTYPE), kb, carried, warming, group, on_group, code)
                  for x, kb, carried in zip(fused, budgets(fused), state.oktopk or [None] * len(fused))]
        # Exact sums of the gradient's streams; over a mesh axis, without a cost model, SSAR_Split_allgather.
        exact_algorithm = "auto" if axis_name is None else "ssar_split_allgather"
        exact = [_reduce_one(s, None, None, group, dict(options, algorithm=exact_algorithm,
                                                        transport=group.transport(transport)), average)
                 for s in given]
        out_fused = [_averaged(total, nprocs, average) for total, *_ in summed]
        out_given = [total for total, *_ in exact]
        reduced_dense = dense_sum(dense, group, average)
        counts = [(nnz, sent, c) for _, _, _, nnz, sent, c in summed] + [
            (st.result_nnz.astype(jnp.float32), st.bytes_sent, st.algorithm) for _, st, *_ in exact]
        stats = _gathered_stats(counts, [x.shape[0] for x in fused] + [s.size for s in given], len(fused))
        new_residual = None
        if error_feedback:
            held = tuple(r for _, r, *_ in summed)
            new_residual = FusedBuffers(held if now == at_init else relaid(held, now, at_init, sizes, into=kept.buffers))
        carried = tuple(c for _, _, c, *_ in summed) if state.oktopk else ()
        new_state = GlobalTopkState(new_residual, inner_state, state.count + 1, stats, carried)
        return _unpacked(packed, reduced_dense, out_fused, out_given, treedef), new_state

    return optax.GradientTransformation(init_fn, update_fn)


def _layout(packed: Any, leaves: list) -> tuple[tuple[int, ...], ...]:
    """The leaves (by flattening index) of each buffer of ``packed`` (:func:`_buffers`)."""
    if hasattr(packed, "plan"):
        return packed.plan.groups
    return tuple((i,) for i, x in enumerate(leaves) if not is_stream(x))


def _buffers(packed: Any) -> tuple[list, list, list]:
    """(dense leaves sent dense, flat buffers for the global top-k, streams summed exactly)."""
    if hasattr(packed, "parts"):
        return packed.parts()
    leaves = jax.tree.leaves(packed, is_leaf=is_stream)
    return [], [jnp.ravel(x) for x in leaves if not is_stream(x)], [x for x in leaves if is_stream(x)]


def _unpacked(packed: Any, dense: list, fused: list, given: list, treedef: Any) -> Any:
    """``packed`` with its parts replaced, as a pytree of the updates' structure."""
    if hasattr(packed, "parts"):
        return packed.replace_parts(dense, fused, given)
    leaves = jax.tree.leaves(packed, is_leaf=is_stream)
    fused, given = iter(fused), iter(given)
    return jax.tree.unflatten(treedef, [next(given) if is_stream(x) else next(fused) for x in leaves])


def _global_topk_sum(x: jax.Array, k: int, carried: Any, warming: jax.Array | None, group: Group,
                     options: dict, code: int) -> tuple:
    """(sum, this rank's residual, carried state, result nnz, bytes sent, algorithm code) of one
    buffer; while ``warming`` the buffer is summed dense and nothing is held back."""

    def global_topk():
        if carried is None:
            total, residual, stats = global_topk_allreduce(x, k, **group.where, return_stats=True, **options)
            state = None
        else:
            total, residual, state, stats = global_topk_allreduce(x, k, **group.where, oktopk_state=carried,
                                                                  return_stats=True, **options)
        return total, residual, state, stats.result_nnz.astype(jnp.float32), stats.bytes_sent, jnp.int32(code)

    if warming is None:
        return global_topk()
    nprocs, n = group.size, x.shape[0]

    def dense_path():
        total = dense_allreduce(x, **group.where) if nprocs > 1 else x
        sent = jnp.float32(2 * (nprocs - 1) / nprocs * 4 * n)
        return total, jnp.zeros_like(x), carried, jnp.float32(n), sent, jnp.int32(SENT_DENSE)

    def sparse_path():
        total, *rest = global_topk()
        return (total.to_dense(), *rest)

    return group.cond(warming, dense_path, sparse_path)


def _gathered_stats(counts: list[tuple], sizes: list[int], fused: int) -> GradientStats:
    """Nonzeros and bytes of every buffer; the algorithm of the largest fused buffer (else stream)."""
    if not counts:
        return GradientStats(0, 0, SENT_DENSE)
    nnz = sum(c[0] for c in counts)
    sent = sum(c[1] for c in counts)
    largest = max(range(fused) if fused else range(len(counts)), key=lambda i: sizes[i])
    return GradientStats(nnz / max(sum(sizes), 1), sent, counts[largest][2])


def densify() -> optax.GradientTransformation:
    """Turns reduced streams back into dense updates of the parameters' shapes and dtypes.

    The fused buffers of a :class:`~sparcml_jax.transform.LeafGroups` are cut back into their
    leaves, in the gradient's dtypes or, given ``params``, in theirs (error feedback sums a
    bfloat16 gradient in float32); the streams the gradient brought stay streams (for
    :func:`sparcml_jax.lazy`). In an ordinary pytree every stream leaf becomes dense, shaped like
    the matching leaf of ``params`` (which must then be passed).

    Example:
      >>> import jax.numpy as jnp
      >>> import sparcml_jax
      >>> params = {"w": jnp.zeros((2, 2))}
      >>> updates = {"w": sparcml_jax.coalesce(jnp.array([3], jnp.int32), jnp.array([5.0]), size=4)}
      >>> sparcml_jax.densify().update(updates, optax.EmptyState(), params)[0]["w"].tolist()
      [[0.0, 0.0], [0.0, 5.0]]
    """

    def update_fn(updates, state, params=None):
        if hasattr(updates, "unpack"):
            out = updates.unpack(cast=True, treedef=True)
            if params is not None:
                out = jax.tree.map(lambda u, p: u if is_stream(u) else u.astype(jnp.result_type(p)), out, params,
                                   is_leaf=is_stream)
            return out, state
        leaves, treedef = jax.tree.flatten(updates, is_leaf=is_stream)
        if any(is_stream(x) for x in leaves) and params is None:
            raise ValueError("densify: pass params to update, so that stream leaves get the parameters' shapes")
        like = [None] * len(leaves) if params is None else treedef.flatten_up_to(params)
        out = [s.to_dense().reshape(jnp.shape(p)).astype(jnp.result_type(p)) if is_stream(s) else s
               for s, p in zip(leaves, like)]
        return jax.tree.unflatten(treedef, out), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def warming_up(count: jax.Array | tuple, warmup_steps: int | jax.Array) -> jax.Array | None:
    """Whether this step warms up, or None when no step ever does (no cond in the program)."""
    return count < warmup_steps if counts_steps(warmup_steps) else None


def counts_steps(warmup_steps: int | jax.Array) -> bool:
    """Whether a stage keeps a step count: with warm-up, or a ``warmup_steps`` that is an array
    (``optax.inject_hyperparams`` passes one, concrete at init and traced at update)."""
    return isinstance(warmup_steps, (jax.Array, jax.core.Tracer)) or int(warmup_steps) > 0


def initial_count(warmup_steps: int | jax.Array) -> jax.Array | tuple:
    return jnp.zeros((), jnp.int32) if counts_steps(warmup_steps) else ()


def next_count(count: jax.Array | tuple) -> jax.Array | tuple:
    return count if isinstance(count, tuple) else count + 1


def initial_key(seed: int) -> jax.Array:
    return jax.random.key_data(jax.random.key(seed))


def check_warmup(warmup_steps: Any) -> None:
    if not isinstance(warmup_steps, jax.core.Tracer) and (jnp.ndim(warmup_steps) != 0 or int(warmup_steps) < 0):
        raise ValueError(f"warmup_steps must be a non-negative int, got {warmup_steps!r}")


def check_budget(density: Any, k: Any) -> None:
    if density is not None and k is not None:
        raise ValueError("pass density or k, not both")
    if density is not None and not (isinstance(density, (int, float)) and 0 < float(density) <= 1):
        raise ValueError(f"density must be a fraction in (0, 1], got {density!r}")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        raise ValueError(f"k must be a positive int, got {k!r}")


def leaf_budget(n: int, total: int, density: float | None, k: int | None) -> int:
    """Entries a leaf of ``n`` keeps: ``ceil(density * n)``, or its share of ``k`` over ``total``."""
    share = math.ceil(density * n) if density is not None else round(k * n / max(total, 1))
    return max(1, min(n, share))

