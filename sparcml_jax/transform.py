"""The optax transformation: data-parallel gradient sums through SparCML's sparse allreduce.

With error feedback (Strom 2015; Seide et al. 2014; SparCML §2 and §6) rank ``i`` keeps a
residual ``r_i``. At step ``t`` it forms ``a_i = g_i + r_i``, sends the stream
``s_i = sparsify(a_i, k)`` and keeps ``r_i <- a_i - s_i``, so nothing is lost: over any number of
steps, everything sent plus the final residual equals the sum of all gradients. The update is
``sum_i s_i`` (divided by ``P`` when averaging), optionally with QSGD on the dense allgather
phase of DSAR (§6), whose unbiased rounding noise is not fed back.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from mpi4py import MPI

from sparcml_jax.collectives import ALGORITHMS, CostModel, dense_allreduce, sparse_allreduce
from sparcml_jax.collectives.nonblocking import sparse_allreduce_start, sparse_allreduce_wait
from sparcml_jax.comm import check_transport, resolve_comm
from sparcml_jax.kernels._common import check_stream
from sparcml_jax.kernels.partition import from_dense, from_dense_counted
from sparcml_jax.sparsifiers import Sparsifier, resolve
from sparcml_jax.stream import INDEX_DTYPE, VALUE_DTYPE, SparseStream, resize

WARMUP_ALGORITHM = -1  # stats.algorithm while sending dense during warm-up


class GradientStats(NamedTuple):
    """What the last update did, for logging.

    Attributes:
      density: float32 nonzeros of the reduced sparse buffers over their length.
      bytes_sent: float32 payload bytes this rank sent in the last update.
      algorithm: int32 index into ``sparcml_jax.ALGORITHMS`` of the largest buffer's algorithm
        (-1 while warming up with dense sends).
    """

    density: jax.Array
    bytes_sent: jax.Array
    algorithm: jax.Array


class AllreduceGradientsState(NamedTuple):
    """Optimizer state: the error-feedback residual (a pytree like the gradients; empty leaves
    without error feedback), the step count, the QSGD/random-k PRNG key data and the last stats."""

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
    algorithm: str = "auto",
    transport: str = "native",
    comm: MPI.Comm | None = None,
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
) -> optax.GradientTransformation:
    """Sums (or averages) gradients across the ranks of ``comm`` with sparse, quantized messages.

    Put it first in an optax chain; every rank then applies the same update.

    Args:
      density: fraction of entries each rank sends per step, in (0, 1].
      k: entries sent per step instead of ``density`` (of the fused buffer, or per leaf).
        With neither, the gradient's actual nonzeros are sent exactly (naturally sparse models).
        A gradient leaf may also be a :class:`SparseStream` over the flattened parameter (for
        example from :func:`sparcml_jax.coalesce`): it is reduced exactly, on its own, without
        ever forming the dense gradient, and its update is the reduced stream. Follow with
        :func:`sparcml_jax.lazy` and apply with :func:`sparcml_jax.apply_updates`.
      sparsifier: ``"topk"``, ``"randomk"``, ``sparcml_jax.sparsifiers.threshold(tau)`` or any
        callable ``(v, k, key) -> SparseStream``.
      error_feedback: keep what was not sent and add it to the next gradient.
      quantize_bits: QSGD bits (2, 4, 8) on DSAR's dense allgather phase.
      algorithm, transport, delta, bucket_size, quantize_scale, cost_model: passed to
        :func:`sparcml_jax.sparse_allreduce`.
      comm: mpi4py communicator; ``None`` is mpi4jax's default (a clone of COMM_WORLD).
      average: divide the sum by the number of ranks.
      warmup_steps: send dense for the first steps (default 0).
      min_size: leaves with fewer entries travel in one dense allreduce (default 1024).
      fuse: reduce all other leaves as one flattened buffer (one collective), or each leaf alone.
      seed: seeds the PRNG key kept in the state (default 0).

    Numeric arguments left at ``None`` take their defaults, so ``optax.inject_hyperparams`` only
    injects what you pass; arguments that decide buffer shapes (``density``, ``k``,
    ``quantize_bits``, ``min_size``, ``delta``, ``bucket_size``, ``capacity``) must then be
    listed in its ``static_args``. ``warmup_steps`` may be injected (and scheduled).
      capacity: exact mode only: a bound on the nonzeros of a rank's gradient buffer. Smaller
        buffers make every pass cheaper; a step in which any rank exceeds it is sent dense.
      buckets: overlap communication with computation, as DDP's gradient buckets do: the large
        leaves, in reverse order (the order in which backpropagation produces a sequential
        model's gradients), are split into this many buckets of about equal size, and each
        bucket's reduction is started on the non-blocking engine as soon as its stream exists
        (:func:`sparcml_jax.sparse_allreduce_start`); the update waits for a bucket only where
        it needs that bucket's result, so the sparsification of later buckets, and whatever
        else XLA schedules there, runs while earlier buckets are reduced. Compile the train
        step with ``jax.jit(..., compiler_options=sparcml_jax.OVERLAP_COMPILER_OPTIONS)`` to
        overlap the backward pass as well: XLA:CPU's default scheduler computes every gradient
        before the first start. Native transport, no ``capacity``.

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
    """
    density, k, quantize_bits, capacity = (_static(v, name) for v, name in (
        (density, "density"), (k, "k"), (quantize_bits, "quantize_bits"), (capacity, "capacity")))
    min_size = 1024 if min_size is None else _static(min_size, "min_size")
    delta = 1.0 if delta is None else _static(delta, "delta")
    bucket_size = 1024 if bucket_size is None else _static(bucket_size, "bucket_size")
    warmup_steps = 0 if warmup_steps is None else warmup_steps
    seed = 0 if seed is None else seed
    if density is not None and k is not None:
        raise ValueError("pass density or k, not both")
    if density is not None and not (isinstance(density, (int, float)) and 0 < float(density) <= 1):
        raise ValueError(f"density must be a fraction in (0, 1], got {density!r}")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        raise ValueError(f"k must be a positive int, got {k!r}")
    if quantize_bits is not None and quantize_bits not in (2, 4, 8):
        raise ValueError(f"quantize_bits must be 2, 4, 8 or None, got {quantize_bits!r}")
    if quantize_bits is not None and algorithm not in ("auto", "dsar_split_allgather"):
        raise ValueError(f"quantize_bits needs algorithm 'auto' or 'dsar_split_allgather', got {algorithm!r}")
    if algorithm != "auto" and algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be 'auto' or one of {ALGORITHMS}, got {algorithm!r}")
    check_transport(transport)
    if not isinstance(warmup_steps, jax.core.Tracer) and (jnp.ndim(warmup_steps) != 0 or int(warmup_steps) < 0):
        raise ValueError(f"warmup_steps must be a non-negative int, got {warmup_steps!r}")
    if capacity is not None and (not isinstance(capacity, int) or capacity < 1 or not (density is None and k is None)):
        raise ValueError(f"capacity bounds the exact mode (density=None, k=None); got capacity={capacity!r}")
    if not isinstance(min_size, int) or min_size < 0:
        raise ValueError(f"min_size must be a non-negative int, got {min_size!r}")
    buckets = _static(buckets, "buckets")
    if buckets is not None:
        if isinstance(buckets, bool) or not isinstance(buckets, int) or buckets < 1:
            raise ValueError(f"buckets must be a positive int or None, got {buckets!r}")
        if transport != "native" or capacity is not None:
            raise ValueError("buckets run on the non-blocking engine: it needs transport='native' and does not "
                             f"support capacity (got transport={transport!r}, capacity={capacity!r})")
    select = resolve(sparsifier)
    exact = density is None and k is None
    # Exact mode sends every nonzero: there is never anything to feed back.
    error_feedback = error_feedback and not exact
    collective = dict(algorithm=algorithm, transport=transport, delta=delta, quantize_bits=quantize_bits,
                      bucket_size=bucket_size, quantize_scale=quantize_scale, cost_model=cost_model)

    def init_fn(params):
        leaves = jax.tree.leaves(params)
        for i, leaf in enumerate(leaves):
            _check_float_leaf(leaf, f"params leaf {i}")
        residual = jax.tree.map(
            lambda p: jnp.zeros(jnp.shape(p), VALUE_DTYPE) if error_feedback else jnp.zeros((0,), VALUE_DTYPE), params
        )
        return AllreduceGradientsState(
            residual=residual,
            step=jnp.zeros((), jnp.int32),
            key=jax.random.key_data(jax.random.key(seed)),
            stats=GradientStats(jnp.float32(0), jnp.float32(0), jnp.int32(WARMUP_ALGORITHM)),
        )

    def update_fn(updates, state, params=None):
        del params
        the_comm = resolve_comm(comm)
        nprocs = the_comm.Get_size()
        leaves, treedef = jax.tree.flatten(updates, is_leaf=_is_stream)
        residual_leaves, residual_def = jax.tree.flatten(state.residual)
        if treedef != residual_def:
            raise ValueError(
                "allreduce_gradients: the gradient pytree differs from the one given to init "
                f"(init: {residual_def}, update: {treedef}); re-run init with the parameters you train"
            )
        stream_leaves = [i for i, leaf in enumerate(leaves) if _is_stream(leaf)]
        if stream_leaves and buckets is not None:
            raise ValueError("allreduce_gradients: SparseStream gradient leaves are not supported with buckets; "
                             "pass buckets=None")
        for i, (leaf, res) in enumerate(zip(leaves, residual_leaves)):
            if _is_stream(leaf):
                check_stream(leaf, f"gradient leaf {i}")
                shape_ok = not error_feedback or leaf.size == res.size
            else:
                _check_float_leaf(leaf, f"gradient leaf {i}")
                shape_ok = not error_feedback or jnp.shape(leaf) == res.shape
            if not shape_ok:
                shape = f"a SparseStream of size {leaf.size}" if _is_stream(leaf) else f"shape {jnp.shape(leaf)}"
                raise ValueError(f"allreduce_gradients: gradient leaf {i} has {shape} but init saw "
                                 f"{res.shape}; re-run init with the parameters you train")
        dtypes = [None if _is_stream(leaf) else jnp.result_type(leaf) for leaf in leaves]
        accumulated = [
            None if _is_stream(g) else
            (jnp.asarray(g, VALUE_DTYPE) + r) if error_feedback else jnp.asarray(g, VALUE_DTYPE)
            for g, r in zip(leaves, residual_leaves)
        ]
        dense_leaves = [i for i, a in enumerate(accumulated) if a is not None]
        small = [i for i in dense_leaves if accumulated[i].size < min_size]
        large = [i for i in dense_leaves if accumulated[i].size >= min_size]
        if buckets is not None:
            groups = _buckets(large[::-1], [accumulated[i].size for i in large[::-1]], buckets)
        else:
            groups = [large] if fuse and large else [[i] for i in large]
        total_large = sum(accumulated[i].size for i in large) + sum(leaves[i].size for i in stream_leaves)

        key, step_key = jax.random.split(jax.random.wrap_key_data(state.key))
        out = [None] * len(leaves)
        new_residual = [jnp.zeros_like(a) if error_feedback and a is not None else r
                        for a, r in zip(accumulated, residual_leaves)]

        scale = 1.0 / nprocs if average else 1.0
        if small:
            flat = jnp.concatenate([accumulated[i].ravel() for i in small])
            summed = dense_allreduce(flat, comm=the_comm) * scale if nprocs > 1 else flat
            _scatter_back(summed, small, accumulated, out)

        nnz_total, bytes_total = jnp.float32(0), jnp.float32(0)
        algorithm_code = jnp.int32(WARMUP_ALGORITHM)
        dynamic_warmup = isinstance(warmup_steps, jax.core.Tracer) or int(warmup_steps) > 0
        if buckets is not None:
            flats = [jnp.concatenate([accumulated[i].ravel() for i in group]) for group in groups]
            streams, rests, keys = [], [], []
            for g, flat in enumerate(flats):
                budget = flat.shape[0] if exact else _budget(flat.shape[0], total_large, density, k, fuse=False)
                keys.append(jax.random.fold_in(step_key, g))
                stream = from_dense(flat, capacity=budget) if exact else select(flat, budget, keys[-1])
                rest = flat - stream.to_dense() if error_feedback else None
                if dynamic_warmup:
                    stream, rest = _dense_while(state.step < warmup_steps, flat, stream, rest)
                streams.append(stream)
                rests.append(rest)
            results = _reduce_in_buckets(streams, keys, the_comm, collective)
            for group, (reduced, stats), rest in zip(groups, results, rests):
                _scatter_back(reduced.to_dense() * scale, group, accumulated, out)
                if error_feedback:
                    _scatter_back(rest, group, accumulated, new_residual)
                nnz_total, bytes_total = nnz_total + stats.result_nnz.astype(jnp.float32), bytes_total + stats.bytes_sent
                if len(group) == max(len(gr) for gr in groups):
                    algorithm_code = jnp.where(state.step < warmup_steps, WARMUP_ALGORITHM, stats.algorithm) \
                        if dynamic_warmup else stats.algorithm
        else:
            for g, group in enumerate(groups):
                flat = jnp.concatenate([accumulated[i].ravel() for i in group])
                n = flat.shape[0]
                budget = n if exact else _budget(n, total_large, density, k, fuse)
                group_key = jax.random.fold_in(step_key, g)

                def sparse_path(flat):
                    if counted is not None:
                        stream = counted
                    elif exact:
                        stream = from_dense(flat, capacity=budget)
                    else:
                        stream = select(flat, budget, group_key)
                    rest = flat - stream.to_dense() if error_feedback else jnp.float32(0)
                    reduced, stats = sparse_allreduce(stream, comm=the_comm, key=group_key, return_stats=True, **collective)
                    if average:  # scaling the nnz values is cheaper than a pass over the dense result
                        reduced = dataclasses.replace(reduced, values=reduced.values / nprocs)
                    return reduced.to_dense(), rest, stats.result_nnz.astype(jnp.float32), stats.bytes_sent, \
                        stats.algorithm

                def dense_path(flat):
                    summed = dense_allreduce(flat, comm=the_comm) * scale
                    sent = jnp.float32(2 * (nprocs - 1) / nprocs * 4 * n)
                    rest = jnp.zeros_like(flat) if error_feedback else jnp.float32(0)
                    return summed, rest, jnp.float32(n), sent, jnp.int32(WARMUP_ALGORITHM)

                send_dense = state.step < warmup_steps if dynamic_warmup else None
                counted = None
                if exact and capacity is not None and capacity < n:
                    budget = capacity
                    counted, count = from_dense_counted(flat, capacity)
                    too_many = _max_over_ranks(count, the_comm) > capacity
                    send_dense = too_many if send_dense is None else send_dense | too_many
                if send_dense is None:
                    summed, rest, nnz, sent, code = sparse_path(flat)
                else:
                    summed, rest, nnz, sent, code = jax.lax.cond(send_dense, dense_path, sparse_path, flat)
                _scatter_back(summed, group, accumulated, out)
                if error_feedback:
                    _scatter_back(rest, group, accumulated, new_residual)
                nnz_total, bytes_total = nnz_total + nnz, bytes_total + sent
                if len(group) == max(len(gr) for gr in groups):
                    algorithm_code = code

        # Naturally sparse gradients travel exactly as given, whatever the dense leaves' sparsifier.
        for i in stream_leaves:
            reduced, stats = sparse_allreduce(leaves[i], comm=the_comm, return_stats=True,
                                              **dict(collective, quantize_bits=None))
            out[i] = dataclasses.replace(reduced, values=reduced.values / nprocs) if average else reduced
            nnz_total, bytes_total = nnz_total + stats.result_nnz.astype(jnp.float32), bytes_total + stats.bytes_sent
            if not large and leaves[i].size == max(leaves[j].size for j in stream_leaves):
                algorithm_code = stats.algorithm

        new_updates = [o if d is None else o.astype(d) for o, d in zip(out, dtypes)]
        stats = GradientStats(nnz_total / max(total_large, 1), bytes_total, algorithm_code)
        new_state = AllreduceGradientsState(
            residual=jax.tree.unflatten(residual_def, new_residual),
            step=state.step + 1,
            key=jax.random.key_data(key),
            stats=stats,
        )
        return jax.tree.unflatten(treedef, new_updates), new_state

    return optax.GradientTransformation(init_fn, update_fn)


def dense_allreduce_gradients(*, comm: MPI.Comm | None = None, average: bool = True) -> optax.GradientTransformation:
    """The baseline: every gradient leaf summed (or averaged) by a dense MPI_Allreduce via mpi4jax.

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
        the_comm = resolve_comm(comm)
        scale = 1.0 / the_comm.Get_size() if average else 1.0
        leaves, treedef = jax.tree.flatten(updates)
        if not leaves:
            return updates, state
        flat = jnp.concatenate([jnp.ravel(leaf).astype(VALUE_DTYPE) for leaf in leaves])
        summed = dense_allreduce(flat, comm=the_comm) * scale
        out = [None] * len(leaves)
        _scatter_back(summed, list(range(len(leaves))), [jnp.asarray(leaf) for leaf in leaves], out)
        return jax.tree.unflatten(treedef, [o.astype(jnp.result_type(leaf)) for o, leaf in zip(out, leaves)]), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def _buckets(order: list[int], sizes: list[int], count: int) -> list[list[int]]:
    """Consecutive runs of ``order`` with about ``sum(sizes) / count`` entries each."""
    total, out, filled = sum(sizes), [[]], 0
    for i, size in zip(order, sizes):
        if out[-1] and filled >= total * len(out) / count:
            out.append([])
        out[-1].append(i)
        filled += size
    return [b for b in out if b]


def _dense_while(warming_up: jax.Array, flat: jax.Array, stream: SparseStream, rest):
    """During warm-up the bucket travels whole (the dense stream); nothing is left to feed back."""
    n = flat.shape[0]
    dense = SparseStream(jnp.arange(n, dtype=INDEX_DTYPE), flat, jnp.int32(n), n)
    stream = jax.lax.cond(warming_up, lambda: dense, lambda: resize(stream, n))
    return stream, None if rest is None else jnp.where(warming_up, 0.0, rest)


def _reduce_in_buckets(streams: list[SparseStream], keys: list[jax.Array], comm: MPI.Comm, collective: dict) -> list:
    """Starts every bucket's reduction in order, then waits for each: the engine reduces bucket b
    while the program goes on to sparsify bucket b + 1 (each start needs its own stream first)."""
    options = {name: value for name, value in collective.items() if name != "transport"}
    handles = [sparse_allreduce_start(s, comm=comm, key=key_g, **options) for s, key_g in zip(streams, keys)]
    return [sparse_allreduce_wait(h, return_stats=True) for h in handles]


def _max_over_ranks(x: jax.Array, comm: MPI.Comm) -> jax.Array:
    import mpi4jax

    return mpi4jax.allreduce(x, op=MPI.MAX, comm=comm) if comm.Get_size() > 1 else x


def _static(value: Any, name: str) -> Any:
    """A Python number from a concrete value; traced values cannot decide static shapes."""
    if isinstance(value, jax.core.Tracer):
        raise TypeError(f"allreduce_gradients: {name} decides buffer shapes and must be static; with "
                        f"optax.inject_hyperparams pass static_args=({name!r}, ...)")
    if isinstance(value, (jax.Array, np.ndarray)):
        return value.item()
    return value


def _is_stream(x: Any) -> bool:
    return isinstance(x, SparseStream)


def _check_float_leaf(leaf: Any, name: str) -> None:
    dtype = jnp.result_type(leaf)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"allreduce_gradients: {name} has dtype {dtype}; only floating-point leaves can be "
                        "summed (mark integer state as non-trainable, e.g. with optax.masked)")


def _budget(n: int, total: int, density: float | None, k: int | None, fuse: bool) -> int:
    if density is not None:
        return max(1, min(n, math.ceil(density * n)))
    share = k if fuse else max(1, round(k * n / max(total, 1)))
    return max(1, min(n, share))


def _scatter_back(flat: jax.Array, group: list[int], like: list[jax.Array], out: list) -> None:
    offset = 0
    for i in group:
        size = like[i].size
        out[i] = flat[offset:offset + size].reshape(like[i].shape)
        offset += size
