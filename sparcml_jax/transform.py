"""The optax preset: data-parallel gradient sums through SparCML's sparse allreduce.

:func:`allreduce_gradients` chains the stages of :mod:`sparcml_jax.stages`:
``fuse_leaves(error_feedback(sparsify(...)))``, then ``reduce_streams(...)``, then ``densify()``.
:func:`fuse_leaves` groups the gradient's leaves (:func:`plan_leaves`, a pure function): small
leaves are sent whole, the others are flattened into fused buffers (one, one per leaf, or
DDP-style buckets), and leaves that already are streams are summed exactly on their own.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Hashable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from mpi4py import MPI

from sparcml_jax.collectives import ALGORITHMS, CostModel
from sparcml_jax.collectives._plan import GLOBAL_TOPK_ALGORITHMS
from sparcml_jax.collectives.group import Group
from sparcml_jax.collectives.validate import raised_everywhere, reject_everywhere
from sparcml_jax.comm import native, resolve_comm
from sparcml_jax.kernels._common import check_stream
from sparcml_jax.sparsifiers import Sparsifier, resolve
from sparcml_jax import sparsifiers, stages
from sparcml_jax.stages import (
    ErrorFeedbackState,
    FusedBuffers,
    GradientStats,
    ReduceState,
    SparsifyState,
    check_budget,
    dense_sum,
    densify,
    global_topk_reduce,
    is_stream,
    leaf_sizes,
    reduce_streams,
    relaid,
    sparsify,
    split_like,
)
from sparcml_jax.stream import VALUE_DTYPE


@dataclasses.dataclass(frozen=True)
class LeafPlan:
    """Which leaves (by flattening index) travel how: see :func:`plan_leaves`."""

    small: tuple[int, ...]
    groups: tuple[tuple[int, ...], ...]
    streams: tuple[int, ...]


def plan_leaves(sizes: Sequence[int], streams: Sequence[bool], *, min_size: int = 1024, fuse: bool = True,
                buckets: int | None = None) -> LeafPlan:
    """Groups leaves by size and kind; pure (no JAX, no MPI).

    Dense leaves below ``min_size`` entries are ``small``. The others form one fused group
    (``fuse``), one group each, or ``buckets`` groups of about equal size in reverse order (the
    order in which backpropagation produces a sequential model's gradients). Stream leaves stay
    alone.

    Example:
      >>> from sparcml_jax import plan_leaves
      >>> plan_leaves([10, 5000, 3000, 4000], [False, False, False, False], buckets=2)
      LeafPlan(small=(0,), groups=((3, 2), (1,)), streams=())
      >>> plan_leaves([5000, 10, 3000], [True, False, False], fuse=False)
      LeafPlan(small=(1,), groups=((2,),), streams=(0,))
    """
    dense = [i for i, s in enumerate(streams) if not s]
    large = [i for i in dense if sizes[i] >= min_size]
    if buckets is not None:
        groups = _buckets(large[::-1], [sizes[i] for i in large[::-1]], buckets)
    else:
        groups = [large] if fuse and large else [[i] for i in large]
    return LeafPlan(small=tuple(i for i in dense if sizes[i] < min_size), groups=tuple(map(tuple, groups)),
                    streams=tuple(i for i, s in enumerate(streams) if s))


def _buckets(order: list[int], sizes: list[int], count: int) -> list[list[int]]:
    """Consecutive runs of ``order`` with about ``sum(sizes) / count`` entries each."""
    total, out, filled = sum(sizes), [[]], 0
    for i, size in zip(order, sizes):
        if out[-1] and filled >= total * len(out) / count:
            out.append([])
        out[-1].append(i)
        filled += size
    return [b for b in out if b]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LeafGroups:
    """A gradient pytree packed by :func:`fuse_leaves`, the stream between the preset's stages.

    Attributes:
      dense: the small leaves, each as it was (sent whole, never sparsified).
      fused: one flat buffer per group (bfloat16 when all its leaves are, else float32), or the
        stream a sparsifier made of it.
      given: the gradient's own :class:`SparseStream` leaves (summed exactly).
      plan: static: the :class:`LeafPlan`.
      like: static: every leaf's shape and dtype (a stream leaf's: ``None``).
      treedef: static: the gradient's tree structure.
    """

    dense: tuple
    fused: tuple
    given: tuple
    plan: LeafPlan = dataclasses.field(metadata=dict(static=True))
    like: tuple = dataclasses.field(metadata=dict(static=True))
    treedef: Any = dataclasses.field(metadata=dict(static=True))

    def parts(self) -> tuple[list, list, list]:
        return list(self.dense), list(self.fused), list(self.given)

    def replace_parts(self, dense: list, fused: list, given: list) -> "LeafGroups":
        return dataclasses.replace(self, dense=tuple(dense), fused=tuple(fused), given=tuple(given))

    def unpack(self, cast: bool = True, treedef: bool = False) -> Any:
        """The leaves again (fused buffers densified and cut; given streams as they are), as a
        list or, with ``treedef``, as the gradient's pytree; ``cast`` restores their dtypes."""
        out = [None] * len(self.like)
        for i, x in zip(self.plan.small, self.dense):
            out[i] = x
        for group, x in zip(self.plan.groups, self.fused):
            like = [self.like[i] if cast else (self.like[i][0], VALUE_DTYPE) for i in group]
            for i, piece in zip(group, split_like(x, like)):
                out[i] = piece
        for i, s in zip(self.plan.streams, self.given):
            out[i] = s
        if cast:
            out = [x if is_stream(x) else x.astype(self.like[i][1]) for i, x in enumerate(out)]
        return jax.tree.unflatten(self.treedef, out) if treedef else out


def fuse_leaves(inner: optax.GradientTransformation | None = None, *, min_size: int = 1024, fuse: bool = True,
                buckets: int | None = None) -> optax.GradientTransformation:
    """Packs the gradient into :class:`LeafGroups` and applies ``inner`` to its fused buffers.

    Like ``optax.flatten(inner)``, for a plan of groups (:func:`plan_leaves`): ``inner`` sees
    the flat buffers as :class:`FusedBuffers` (:func:`fused_dtype`; at init: of the parameters)
    and typically sparsifies them, so that top-k picks across the layers of a group; its state
    is in that layout (an inner :func:`~sparcml_jax.error_feedback` keeps one residual vector per
    buffer, which :func:`unfuse_leaves` cuts back into the parameters' leaves). Gradient leaves
    that are streams leave their groups; the residual's segments of the other leaves then follow
    them, and a stream leaf's segment is kept for when it comes back dense. Follow with
    :func:`reduce_streams` and :func:`densify`.

    Example:
      >>> import jax.numpy as jnp
      >>> import sparcml_jax
      >>> tx = sparcml_jax.fuse_leaves(sparcml_jax.sparsify(k=1), min_size=2)
      >>> grads = {"a": jnp.array([1.0, 9.0]), "b": jnp.array([[5.0, -7.0]]), "c": jnp.array([3.0])}
      >>> groups, _ = tx.update(grads, tx.init(grads))
      >>> groups.fused[0].indices.tolist(), groups.fused[0].values.tolist(), groups.dense[0].tolist()
      ([1], [9.0], [3.0])
    """
    planned = dict(min_size=min_size, fuse=fuse, buckets=buckets)

    def pack(tree: Any) -> LeafGroups:
        leaves, treedef = jax.tree.flatten(tree, is_leaf=is_stream)
        for i, leaf in enumerate(leaves):
            if is_stream(leaf):
                check_stream(leaf, f"gradient leaf {i}")
            else:
                check_float_leaf(leaf, f"gradient leaf {i}")
        kinds = [is_stream(x) for x in leaves]
        if buckets is not None and any(kinds):
            raise ValueError("allreduce_gradients: SparseStream gradient leaves are not supported with buckets; "
                             "pass buckets=None")
        plan = plan_leaves(leaf_sizes(leaves), kinds, **planned)
        fused = tuple(stages.join_flat([leaves[i] for i in group], fused_dtype([leaves[i] for i in group]))
                      for group in plan.groups)
        like = tuple(None if s else (jnp.shape(x), jnp.result_type(x)) for x, s in zip(leaves, kinds))
        return LeafGroups(tuple(leaves[i] for i in plan.small), fused, tuple(leaves[i] for i in plan.streams),
                          plan, like, treedef)

    def init_fn(params):
        return optax.EmptyState() if inner is None else inner.init(FusedBuffers(pack(params).fused))

    def update_fn(updates, state, params=None):
        del params
        groups = pack(updates)
        if inner is None:
            return groups, state
        leaves = jax.tree.leaves(updates, is_leaf=is_stream)
        sizes = leaf_sizes(leaves)
        at_init, shapes = _dense_plan(sizes, planned)  # the plan inner.init saw
        kept = state.residual if isinstance(state, ErrorFeedbackState) else None
        if kept is not None:
            stages.check_fused_residual("fuse_leaves", kept, shapes)
        moved = kept is not None and at_init.groups != groups.plan.groups
        if moved:
            state = state._replace(residual=FusedBuffers(relaid(kept.buffers, at_init.groups, groups.plan.groups,
                                                                 sizes)))
        fused, state = inner.update(FusedBuffers(groups.fused), state)
        if moved:
            state = state._replace(residual=FusedBuffers(relaid(state.residual.buffers, groups.plan.groups,
                                                                 at_init.groups, sizes, into=kept.buffers)))
        fused = fused.buffers if isinstance(fused, FusedBuffers) else fused
        return dataclasses.replace(groups, fused=tuple(fused)), state

    return optax.GradientTransformation(init_fn, update_fn)


def _dense_plan(sizes: list[int], planned: dict) -> tuple[LeafPlan, list[tuple[int]]]:
    """The plan of leaves of these sizes were they all dense, as :func:`fuse_leaves`'s init sees
    the parameters, and the shape of each group's buffer."""
    plan = plan_leaves(sizes, [False] * len(sizes), **planned)
    return plan, [(sum(sizes[i] for i in group),) for group in plan.groups]


def unfuse_leaves(buffers: FusedBuffers | Sequence[jax.Array], params: Any, *, min_size: int = 1024,
                  fuse: bool = True, buckets: int | None = None) -> Any:
    """Flat buffers in :func:`fuse_leaves`'s layout (one per group of :func:`plan_leaves` over the
    parameters' leaves, with the same ``min_size``, ``fuse`` and ``buckets``) cut back into a
    pytree like ``params``: a leaf in no group (below ``min_size``) is zeros. It shows the
    residual of :func:`allreduce_gradients` (any algorithm) per parameter.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> import sparcml_jax
      >>> params = {"b": jnp.zeros(2), "w": jnp.zeros((2, 2))}
      >>> tx = sparcml_jax.allreduce_gradients(k=1, min_size=3)
      >>> _, state = tx.update({"b": jnp.ones(2), "w": jnp.array([[1.0, -4.0], [2.0, 0.5]])}, tx.init(params))
      >>> residual = optax.tree_utils.tree_get(state, "residual")
      >>> [r.tolist() for r in residual.buffers]  # one vector per fused buffer: here "w"
      [[1.0, 0.0, 2.0, 0.5]]
      >>> sparcml_jax.unfuse_leaves(residual, params, min_size=3)["w"].tolist()
      [[1.0, 0.0], [2.0, 0.5]]
    """
    if not isinstance(buffers, (FusedBuffers, tuple, list)):
        raise TypeError(f"unfuse_leaves takes FusedBuffers (or a sequence of flat buffers), got "
                        f"{type(buffers).__name__}: pass the state's residual, "
                        "optax.tree_utils.tree_get(state, 'residual')")
    buffers = buffers.buffers if isinstance(buffers, FusedBuffers) else tuple(buffers)
    leaves, treedef = jax.tree.flatten(params)
    planned = dict(min_size=min_size, fuse=fuse, buckets=buckets)
    plan, shapes = _dense_plan(leaf_sizes(leaves), planned)
    if [jnp.shape(x) for x in buffers] != shapes:
        raise ValueError(f"unfuse_leaves: buffers of shapes {[jnp.shape(x) for x in buffers]} for groups of shapes "
                         f"{shapes} ({planned}); pass the min_size, fuse and buckets of the transform that made them")
    out = [jnp.zeros(jnp.shape(x), VALUE_DTYPE) for x in leaves]
    for group, flat in zip(plan.groups, buffers):
        for i, piece in zip(group, split_like(flat, [(jnp.shape(leaves[i]), VALUE_DTYPE) for i in group])):
            out[i] = piece
    return jax.tree.unflatten(treedef, out)


def _fused_residual(residual: Any, planned: dict) -> FusedBuffers:
    """A residual per parameter leaf in :func:`fuse_leaves`'s layout (the inverse of :func:`unfuse_leaves`)."""
    leaves = jax.tree.leaves(residual)
    plan, _ = _dense_plan(leaf_sizes(leaves), planned)
    return FusedBuffers(tuple(stages.join_flat([leaves[i] for i in group], VALUE_DTYPE) for group in plan.groups))


def fused_dtype(leaves: list) -> Any:
    """A group's buffer: bfloat16 when every leaf is (so that a bfloat16 model's gradient goes
    to the allreduce without a float32 copy), else float32."""
    bfloat16 = all(jnp.result_type(x) == jnp.bfloat16 for x in leaves)
    return jnp.bfloat16 if bfloat16 else VALUE_DTYPE


class AllreduceGradientsState(NamedTuple):
    """The single-NamedTuple state that older checkpoints of :func:`allreduce_gradients` hold.

    :func:`allreduce_gradients` continues from it (its update converts it to the chained state
    of its stages, with the same residual, step count, key and stats).
    """

    residual: Any
    step: jax.Array
    key: jax.Array
    stats: GradientStats


def allreduce_gradients(
    *,
    density: float | None = None,
    k: int | None = None,
    sparsifier: str | Sparsifier = "topk",
    error_feedback: bool = True,
    quantize_bits: int | None = None,
    quantize_feedback: bool = False,
    value_dtype: Any = None,
    algorithm: str = "auto",
    transport: str | None = None,
    comm: MPI.Comm | None = None,
    axis_name: Hashable | None = None,
    average: bool = True,
    warmup_steps: int | None = None,
    min_size: int | None = None,
    fuse: bool = True,
    seed: int | None = None,
    delta: float | None = None,
    bucket_size: int | None = None,
    quantize_scale: str = "max",
    cost_model: CostModel | None = None,
    capacity: int | None = None,
    buckets: int | None = None,
    teams: int | None = None,
    tau: int | None = None,
    tau_prime: int | None = None,
    ordered: bool = True,
) -> optax.GradientTransformation:
    """Sums (or averages) gradients across the ranks of ``comm`` with sparse, quantized messages.

    Put it first in an optax chain; every rank then applies the same update. It is
    ``optax.chain(fuse_leaves(error_feedback(sparsify(...))), reduce_streams(...), densify())``
    (without :func:`~sparcml_jax.sparsify` and error feedback when neither ``density`` nor ``k``
    is given); ``optax.tree_utils.tree_get(state, "residual")`` and ``(state, "stats")`` find
    the residual, a :class:`FusedBuffers` of one float32 vector per fused buffer
    (:func:`unfuse_leaves` cuts it into the parameters' leaves), and the last
    :class:`GradientStats`. Given ``params``, ``update`` checks that
    the gradient has their leaves and shapes.

    Args:
      density: fraction of entries each rank sends per step, in (0, 1].
      k: entries sent per step instead of ``density`` (of the fused buffer, or shared among the
        leaves in proportion to their sizes). With neither, the gradient's actual nonzeros are
        sent exactly (naturally sparse models). A gradient leaf may also be a
        :class:`SparseStream` over the flattened parameter (for example from
        :func:`sparcml_jax.coalesce`): it is reduced exactly, on its own, without ever forming
        the dense gradient, and its update is the reduced stream. Follow with
        :func:`sparcml_jax.lazy` and apply with :func:`sparcml_jax.apply_updates`.
      sparsifier: ``"topk"``, ``"randomk"``, ``sparcml_jax.sparsifiers.threshold(tau)`` or any
        callable ``(v, k, key) -> SparseStream``.
      error_feedback: keep what was not sent and add it to the next gradient.
      quantize_bits: QSGD bits (2, 4, 8) wherever the sum travels dense: DSAR's split-phase
        segments that turned dense and its allgather phase carry b-bit codes and one float32
        scale per ``bucket_size`` values; sparse segments stay exact pairs. ``"auto"`` then
        takes neither the float32 dense allreduce nor the ring, so without ``density`` a dense
        gradient is quantized end to end (about b/32 of float32's bytes, both phases); warm-up
        steps still travel in float32. The small leaves (``min_size``) travel inside the first
        fused buffer's collective, so they are coded where its sum goes dense.
      quantize_feedback: with ``quantize_bits`` and no ``density``/``k``: error feedback for
        the split phase's coding (EF-SGD): each rank adds what its codes lost last step to its
        next gradient buffer (the state's ``quantization_error``). The allgather phase's error is
        shared by every rank and left to QSGD's unbiasedness. QSGD is unbiased already, so this
        bounds the accumulated error rather than a bias; at 2 bits (one level per sign) the error
        can be as large as its bucket's scale and feeds on itself (digits, P = 4, 20 epochs:
        4.7 points below float32 with it, 0.3 without); use it at 4 or 8 bits.
      value_dtype: ``jnp.bfloat16``: the gradient's values travel as bfloat16, sparse pairs
        included, and the small leaves where they ride in the fused buffer's collective (half a
        float32 value's bytes; sums stay float32); any transport, no ``buckets``. See
        :func:`sparcml_jax.sparse_allreduce`. Independently of it, a bfloat16 gradient without
        ``density``/``k`` goes to the native engine in bfloat16 buffers, with no float32 copy
        (:func:`sparcml_jax.nonzeros_allreduce`); error feedback, ``capacity``, warm-up and
        ``buckets`` sum a float32 copy. Given ``params``, the updates take their dtypes.
      algorithm: SparCML's, passed to :func:`sparcml_jax.sparse_allreduce` (``"auto"`` or one of
        ``sparcml_jax.ALGORITHMS``), or a global top-k allreduce (one of
        ``sparcml_jax.GLOBAL_TOPK_ALGORITHMS``: ``"spardl"``, ``"oktopk"``, ``"gtopk"``). A
        global top-k one sums ``gradient + residual`` with
        :func:`sparcml_jax.global_topk_allreduce`, whose result keeps about ``k`` (or ``density``
        of the entries) whatever the number of ranks, and keeps the residual it returns as the
        error feedback (and Ok-Topk's thresholds and regions in the state): the chain is
        ``optax.chain(global_topk_reduce(fuse_leaves(...)), densify())``. It selects by magnitude
        inside the collective, so it takes neither ``sparsifier`` nor ``quantize_bits``,
        ``bucket_size``, ``quantize_scale``, ``cost_model`` or ``buckets``.
      transport, delta, bucket_size, quantize_scale, cost_model: passed to
        :func:`sparcml_jax.sparse_allreduce` (``transport`` and ``delta`` also to
        :func:`sparcml_jax.global_topk_allreduce`).
      comm: mpi4py communicator; ``None`` is mpi4jax's default (a clone of COMM_WORLD).
      axis_name: instead of ``comm``, for a train step inside ``jax.shard_map`` (or
        ``jax.pmap``): sum over the devices of this mesh axis with XLA's collectives, in place of
        ``jax.lax.pmean(grads, axis_name)``. ``algorithm="auto"`` then chooses with
        ``cost_model``, else ``SPARCML_JAX_COST_MODEL``, else (for an axis over all devices) a
        model measured over them at the first trace; the updates are identical on every device
        (typed as varying over the axis: return them with ``check_vma=False``).
      average: divide the sum by the number of ranks.
      warmup_steps: send dense for the first steps (default 0).
      min_size: leaves with fewer entries are sent whole, never sparsified (default 1024). They
        ride in the first fused buffer's collective, after its entries: one collective per step.
        They take a dense allreduce of their own with ``buckets``, ``capacity`` or
        ``quantize_feedback`` (see :func:`sparcml_jax.reduce_streams`).
      fuse: reduce all other leaves as one flattened buffer (one collective), or each leaf alone.
      seed: seeds the PRNG keys kept in the state (default 0).
      capacity: exact mode only: a bound on the nonzeros of a rank's gradient buffer. Smaller
        buffers make every pass cheaper; a step in which any rank exceeds it is sent dense.
      buckets: overlap communication with computation, as DDP's gradient buckets do: the large
        leaves, in reverse order, are split into this many buckets of about equal size, and each
        bucket's reduction is started on the non-blocking engine
        (:func:`sparcml_jax.sparse_allreduce_start`) before the update waits for any. Compile the
        train step with ``jax.jit(..., compiler_options=sparcml_jax.OVERLAP_COMPILER_OPTIONS)``
        so that XLA:CPU starts each bucket during the backward pass. Native transport, no
        ``capacity``.
      teams: ``algorithm="spardl"`` only: SparDL's teams G, a divisor of the number of ranks
        (default 1, the plain allgather); see :func:`sparcml_jax.global_topk_allreduce`.
      tau, tau_prime: ``algorithm="oktopk"`` only: steps between exact thresholds (default 128)
        and between re-balanced regions (default 64).
      ordered: ``False``: the step's collective carries no JAX effect, so a jitted train step
        whose only MPI call it is takes JAX's C++ dispatch path. Any effect sends every call of
        the step through JAX's Python path, which handles each argument and result one by one:
        about 1 ms per step for a small CNN with Adam, more than its whole sparse collective.
        Nothing then orders the call against other MPI calls of the same program, so it must be
        the step's only one. A second unordered call traced into the step (``fuse=False`` with
        several large leaves, a second transform, also in a branch of ``lax.cond`` that never
        runs, or under ``optax.MultiSteps``, which traces the update twice) raises as the step is
        traced; a call on an ordered effect (mpi4jax's, this package's others) and a program over
        several devices raise as it is lowered. Not caught: one jitted function holding the
        update, called twice on independent data inside another jitted function. Programs are
        ordered among themselves: a CPU device runs its programs in the order they were
        dispatched. SparCML's algorithms on the native transport over ``comm`` only, without
        ``buckets``, ``capacity`` or ``quantize_feedback`` (the small leaves then ride in the
        collective of the fused buffer).

    Numeric arguments left at ``None`` take their defaults, so ``optax.inject_hyperparams`` only
    injects what you pass; arguments that decide buffer shapes (``density``, ``k``,
    ``quantize_bits``, ``min_size``, ``delta``, ``bucket_size``, ``capacity``, ``teams``, ``tau``,
    ``tau_prime``) must then be listed in its ``static_args``. ``warmup_steps`` may be injected
    (and scheduled).

    Example (also runs as a single process, where it is the identity):
      >>> import jax, jax.numpy as jnp, optax
      >>> import sparcml_jax
      >>> params = {"w": jnp.ones((64, 64)), "b": jnp.zeros(64)}
      >>> tx = optax.chain(sparcml_jax.allreduce_gradients(density=0.01), optax.sgd(0.1))
      >>> state = tx.init(params)
      >>> grads = jax.tree.map(jnp.ones_like, params)
      >>> updates, state = jax.jit(tx.update)(grads, state, params)
      >>> int((updates["w"] != 0).sum())  # ceil(1 % of 4096) weights this step; the rest waits
      41
      >>> float(optax.tree_utils.tree_get(state, "stats").density)  # those and the 64 biases, of 4160
      0.02524038404226303
    """
    density, k, quantize_bits, capacity, buckets = (_static(v, name) for v, name in (
        (density, "density"), (k, "k"), (quantize_bits, "quantize_bits"), (capacity, "capacity"),
        (buckets, "buckets")))
    min_size = 1024 if min_size is None else _static(min_size, "min_size")
    warmup_steps = 0 if warmup_steps is None else warmup_steps
    seed = 0 if seed is None else seed
    check_budget(density, k)
    resolve(sparsifier)
    exact = density is None and k is None
    if algorithm != "auto" and algorithm not in (*ALGORITHMS, *GLOBAL_TOPK_ALGORITHMS):
        raise ValueError(f"algorithm must be 'auto' or one of {ALGORITHMS + GLOBAL_TOPK_ALGORITHMS}, got {algorithm!r}")
    if capacity is not None and (not isinstance(capacity, int) or capacity < 1 or not exact):
        raise ValueError(f"capacity bounds the exact mode (density=None, k=None); got capacity={capacity!r}")
    if not isinstance(min_size, int) or min_size < 0:
        raise ValueError(f"min_size must be a non-negative int, got {min_size!r}")
    teams, tau, tau_prime = (_static(v, name) for v, name in ((teams, "teams"), (tau, "tau"),
                                                                (tau_prime, "tau_prime")))
    for name, value, owner in (("teams", teams, "spardl"), ("tau", tau, "oktopk"), ("tau_prime", tau_prime, "oktopk")):
        if value is not None and algorithm != owner:
            raise ValueError(f"{name} is a keyword of algorithm={owner!r}, not of algorithm={algorithm!r}: drop {name} "
                             f"or pass algorithm={owner!r}")
    if not ordered and (algorithm in GLOBAL_TOPK_ALGORITHMS or transport not in (None, "native")
                        or axis_name is not None or buckets is not None or capacity is not None or quantize_feedback):
        raise ValueError("ordered=False makes one unordered MPI call per step: it needs SparCML's algorithms on "
                         "transport='native' over comm, without buckets, capacity or quantize_feedback (got "
                         f"algorithm={algorithm!r}, transport={transport!r}, axis_name={axis_name!r}, "
                         f"buckets={buckets!r}, capacity={capacity!r}, quantize_feedback={quantize_feedback!r}); "
                         "drop ordered=False or those arguments")
    if algorithm in GLOBAL_TOPK_ALGORITHMS:
        _check_global_topk(algorithm, exact=exact, sparsifier=sparsifier, quantize_bits=quantize_bits,
                           quantize_feedback=quantize_feedback or None, value_dtype=value_dtype, bucket_size=bucket_size,
                           quantize_scale=quantize_scale, cost_model=cost_model, buckets=buckets)
        return _with_param_checks(optax.chain(global_topk_reduce(
            fuse_leaves(min_size=min_size, fuse=fuse), algorithm=algorithm, density=density, k=k,
            error_feedback=error_feedback, transport=transport, comm=comm, axis_name=axis_name, average=average,
            delta=1.0 if delta is None else _static(delta, "delta"), warmup_steps=warmup_steps,
            teams=1 if teams is None else teams, tau=128 if tau is None else tau,
            tau_prime=64 if tau_prime is None else tau_prime), densify()), comm=comm, axis_name=axis_name)
    if quantize_feedback and (quantize_bits is None or not exact or buckets is not None):
        raise ValueError("quantize_feedback feeds QSGD's split-phase error back into dense gradients: it needs "
                         "quantize_bits, no density or k (top-k segments travel as exact pairs) and no buckets "
                         f"(got quantize_bits={quantize_bits!r}, density={density!r}, k={k!r}, buckets={buckets!r})")
    if buckets is not None and (isinstance(buckets, bool) or not isinstance(buckets, int) or buckets < 1):
        raise ValueError(f"buckets must be a positive int or None, got {buckets!r}")
    if buckets is not None and (transport not in (None, "native") or capacity is not None or axis_name is not None):
        raise ValueError("buckets run on the non-blocking engine: it needs transport='native' over MPI and does not "
                         f"support capacity (got transport={transport!r}, capacity={capacity!r}, "
                         f"axis_name={axis_name!r})")
    reduce = reduce_streams(
        algorithm=algorithm, transport=transport, comm=comm, axis_name=axis_name, average=average,
        quantize_bits=quantize_bits,
        delta=1.0 if delta is None else _static(delta, "delta"), quantize_scale=quantize_scale,
        bucket_size=1024 if bucket_size is None else _static(bucket_size, "bucket_size"), cost_model=cost_model,
        capacity=capacity, warmup_steps=warmup_steps, nonblocking=buckets is not None, seed=seed,
        quantize_feedback=bool(quantize_feedback), value_dtype=value_dtype)
    compress = None if exact else sparsify(sparsifier, density=density, k=k, warmup_steps=warmup_steps, seed=seed)
    with_feedback = error_feedback and not exact  # exact mode sends every nonzero: nothing to feed back
    planned = dict(min_size=min_size, fuse=fuse, buckets=buckets)
    # Error feedback on the fused buffers: the residual is one vector per buffer, added and
    # updated where the sparsifier works, never joined from or cut into the leaves.
    fused = fuse_leaves(stages.error_feedback(compress) if with_feedback else compress, **planned)
    if quantize_feedback:  # its state is sized by the fused buffers of the parameters
        reduce = _init_on_packed(reduce, fused)
    chained = optax.chain(fused, reduce, densify())
    layout = dict(count=stages.counts_steps(warmup_steps), sparsify_key=resolve(sparsifier) is not sparsifiers.topk,
                  reduce_key=quantize_bits is not None)

    def from_older(state: Any, updates: Any) -> Any:
        if isinstance(state, AllreduceGradientsState):
            state = _from_single_state(state, with_feedback, exact, **layout)
        first = state[0]
        if with_feedback and isinstance(first, ErrorFeedbackState) and _per_leaf(first.residual, updates):
            state = (first._replace(residual=_fused_residual(first.residual, planned)), *state[1:])
        return state

    return _with_param_checks(chained, from_older, comm=comm, axis_name=axis_name, buckets=buckets is not None,
                              ordered=ordered)


def _per_leaf(residual: Any, updates: Any) -> bool:
    """Whether ``residual`` holds one array per gradient leaf, as states written before error
    feedback moved onto the fused buffers do (:class:`FusedBuffers` marks the current layout)."""
    if isinstance(residual, FusedBuffers):
        return False
    leaves, treedef = jax.tree.flatten(updates, is_leaf=is_stream)
    kept, kept_def = jax.tree.flatten(residual)
    return kept_def == treedef and [np.size(r) for r in kept] == leaf_sizes(leaves)


def _init_on_packed(tx: optax.GradientTransformation, fused: optax.GradientTransformation):
    """``tx`` whose ``init`` sees the parameters packed as ``fused`` packs the gradient."""
    return optax.GradientTransformation(lambda params: tx.init(fused.update(params, fused.init(params))[0]), tx.update)


def _with_param_checks(chained: optax.GradientTransformation, from_older=None, *, comm: MPI.Comm | None = None,
                       axis_name: Hashable | None = None, buckets: bool = False,
                       ordered: bool = True) -> optax.GradientTransformation:
    """``chained`` with float parameters checked at init, continuing a state of an older layout
    through ``from_older(state, updates)``; with ``ordered=False``, its one MPI call unordered.

    An update that one rank rejects (a gradient or a state that does not fit, found as the step
    is traced, before any message) is rejected on every rank of ``comm``: the peers, already in
    the step's first collective, raise instead of waiting for this rank. Over a mesh axis every
    device traces the same program, so the error is everywhere already. With ``buckets`` the
    peers' buckets are in flight on the engine and their small leaves in an MPI_Allreduce, which
    one rejection cannot end: there the error stays on this rank.
    """

    def init_fn(params):
        for i, leaf in enumerate(jax.tree.leaves(params)):
            check_float_leaf(leaf, f"params leaf {i}")
        return chained.init(params)

    def checked_update(updates, state, params):
        if params is not None:
            check_like_params(updates, params)
        if from_older is not None:
            state = from_older(state, updates)
        elif isinstance(state, AllreduceGradientsState):
            raise ValueError("allreduce_gradients: a checkpoint of the single-NamedTuple layout holds SparCML's "
                             "error feedback, not a global top-k residual; start from tx.init(params)")
        with contextlib.nullcontext() if ordered else native.unordered_calls():
            return chained.update(updates, state, params)

    def update_fn(updates, state, params=None):
        try:
            return checked_update(updates, state, params)
        except (TypeError, ValueError) as e:
            if axis_name is not None or buckets or raised_everywhere(e):
                raise
            reject_everywhere(resolve_comm(comm), e)

    return optax.GradientTransformation(init_fn, update_fn)


def _check_global_topk(algorithm: str, *, exact: bool, sparsifier: Any, **others: Any) -> None:
    """Rejects, by name, the arguments a global top-k allreduce has no use for."""
    if exact:
        raise ValueError(f"algorithm={algorithm!r} needs density or k (the size of the global result)")
    if not (isinstance(sparsifier, str) and sparsifier == "topk"):
        raise ValueError(f"algorithm={algorithm!r} selects the top k inside the collective; sparsifier={sparsifier!r} "
                         "cannot be used with it (leave sparsifier='topk')")
    why = dict(quantize_bits="QSGD quantizes the dense phase of SparCML's DSAR",
               quantize_feedback="QSGD quantizes the dense phase of SparCML's DSAR",
               value_dtype="bfloat16 values travel with SparCML's algorithms only",
               bucket_size="QSGD quantizes the dense phase of SparCML's DSAR",
               quantize_scale="QSGD quantizes the dense phase of SparCML's DSAR",
               cost_model="the cost model chooses among SparCML's algorithms",
               buckets="the global top-k allreduce runs blocking, not on the non-blocking engine")
    for name, value in others.items():
        if value != "max" if name == "quantize_scale" else value is not None:
            raise ValueError(f"algorithm={algorithm!r} does not take {name}={value!r}: {why[name]}")


def _from_single_state(old: AllreduceGradientsState, with_feedback: bool, exact: bool, *, count: bool,
                       sparsify_key: bool, reduce_key: bool) -> tuple:
    """The chained state that continues a checkpoint of the single-NamedTuple layout, keeping the
    step count and the keys where the stages keep them."""
    step = old.step if count else ()
    sparsify_state = SparsifyState(step, old.key if sparsify_key else ())
    first = (optax.EmptyState() if exact else
             ErrorFeedbackState(old.residual, sparsify_state) if with_feedback else sparsify_state)
    if with_feedback and any(np.size(r) == 0 for r in jax.tree.leaves(old.residual)):
        raise ValueError("allreduce_gradients: this checkpoint was written without error feedback (its residual "
                         "is empty); restore it into allreduce_gradients(..., error_feedback=False) or start from "
                         "tx.init(params)")
    return first, ReduceState(step, old.key if reduce_key else (), old.stats), optax.EmptyState()


def dense_allreduce_gradients(*, comm: MPI.Comm | None = None, axis_name: Hashable | None = None,
                              average: bool = True) -> optax.GradientTransformation:
    """The baseline: every gradient leaf summed (or averaged) by a dense MPI_Allreduce via mpi4jax
    (with ``axis_name``, inside ``jax.shard_map``: ``jax.lax.psum`` over that mesh axis).

    Example:
      >>> import jax.numpy as jnp, optax
      >>> import sparcml_jax
      >>> tx = optax.chain(sparcml_jax.dense_allreduce_gradients(), optax.sgd(0.1))
      >>> updates, _ = tx.update({"w": jnp.ones(3)}, tx.init({"w": jnp.ones(3)}))
      >>> [round(v, 3) for v in updates["w"].tolist()]  # averaged over the ranks, then scaled by -0.1
      [-0.1, -0.1, -0.1]
    """

    def update_fn(updates, state, params=None):
        del params
        leaves, treedef = jax.tree.flatten(updates)
        return jax.tree.unflatten(treedef, dense_sum(leaves, Group.of(comm, axis_name), average)), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def _static(value: Any, name: str) -> Any:
    """A Python number from a concrete value; traced values cannot decide static shapes."""
    if isinstance(value, jax.core.Tracer):
        raise TypeError(f"allreduce_gradients: {name} decides buffer shapes and must be static; with "
                        f"optax.inject_hyperparams pass static_args=({name!r}, ...)")
    if isinstance(value, (jax.Array, np.ndarray)):
        return value.item()
    return value


def check_like_params(updates: Any, params: Any) -> None:
    """The gradient has the parameters' leaves, in order, each of their shape (a stream leaf:
    their size); the containers may differ (a dict for a FrozenDict, a list for a tuple)."""
    leaves = jax.tree.leaves(updates, is_leaf=is_stream)
    like = jax.tree.leaves(params)
    if len(leaves) != len(like):
        raise ValueError(f"allreduce_gradients: the gradient has {len(leaves)} leaves and the parameters "
                         f"{len(like)}; pass the gradient of the parameters you train")
    stages.check_leaf_shapes("allreduce_gradients", leaves, like, "its parameter has shape",
                             "pass the gradient of the parameters you train")


def check_float_leaf(leaf: Any, name: str) -> None:
    dtype = jnp.result_type(leaf)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"allreduce_gradients: {name} has dtype {dtype}; only floating-point leaves can be "
                        "summed (mark integer state as non-trainable, e.g. with optax.masked)")
