"""Every use of JAX's and mpi4jax's private modules, in one place: they may move between releases.

- ``abstract_token``: the abstract value of an XLA token (``jax.ffi.abstract_token`` from JAX 0.11).
- ``apply_primitive``: the eager implementation of a primitive.
- ``ordered_effect``: mpi4jax's ordered effect. Our MPI ops join the SAME effect object, because
  two chains order each call only against its own kind and deadlock when mixed (see design.md).
- ``default_comm``: mpi4jax's default communicator (a clone of COMM_WORLD).
- the runtime tokens of ordered effects, which keep a failed program's error until cleared.
- ``varying_axes``: the ``shard_map`` mesh axes a value varies over (``aval.mat.varying`` from
  JAX 0.10, ``aval.vma`` before).
- ``backends_started``: whether JAX's backends exist already (XLA_FLAGS no longer apply then).
- ``outside_trace``: a call run now even while a step is being traced (JAX's trace state is per thread).
- ``enclosing_traces``: the jaxpr traces a call is being staged into, innermost first.
- ``lowered_for_devices``: how many devices the program being lowered runs on.
"""

from __future__ import annotations

import concurrent.futures
from typing import Callable, TypeVar

import jax
from jax._src.core import abstract_token, trace_ctx
from jax._src.dispatch import apply_primitive, runtime_tokens
from jax._src.interpreters.partial_eval import DynamicJaxprTrace
from jax._src.sharding_impls import ShardingContext, SPMDAxisContext
from jax._src.xla_bridge import backends_are_initialized as backends_started
from mpi4jax._src.utils import get_default_comm as default_comm
from mpi4jax._src.utils import ordered_effect

__all__ = ["abstract_token", "apply_primitive", "backends_started", "clear_runtime_tokens", "default_comm",
           "enclosing_traces", "lowered_for_devices", "ordered_effect", "outside_trace", "runtime_token_values",
           "varying_axes"]

T = TypeVar("T")


def clear_runtime_tokens() -> None:
    """Forgets JAX's runtime tokens of ordered effects (and any error they hold)."""
    runtime_tokens.clear()


def runtime_token_values() -> list:
    """The runtime tokens JAX holds now (a failed program's token raises when blocked on)."""
    return list(runtime_tokens.current_tokens.values()) + list(runtime_tokens.output_runtime_tokens.values())


def varying_axes(x) -> frozenset:
    """The manual mesh axes ``x`` varies over inside ``shard_map`` (none outside it)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)
    return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def outside_trace(call: Callable[[], T]) -> T:
    """``call()`` on a fresh thread. A collective's first call on a communicator, or a rank's
    rejection of its arguments, usually happens while the user's train step is being traced, and
    JAX's trace state is per thread: inside the trace a jitted call would only be staged into the
    step, and eager kernels ran 10x slower (even under ``ensure_compile_time_eval``); on a fresh
    thread they run now, as they would in a step."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(call).result()


def enclosing_traces() -> list:
    """The jaxpr traces (``jit``, control-flow bodies) a call made now is staged into, innermost
    first, through any transformation between them (``vmap``, ``grad``): empty for an eager call."""
    traces, trace = [], trace_ctx.trace
    while trace is not None:
        if isinstance(trace, DynamicJaxprTrace):
            traces.append(trace)
        trace = getattr(trace, "parent_trace", None)
    return traces


def lowered_for_devices(module_context) -> int:
    """The number of devices of the program a lowering rule's ``ctx.module_context`` belongs to
    (``pmap``'s replicas count as more than one)."""
    axis = module_context.axis_context
    if isinstance(axis, ShardingContext):
        return axis.num_devices
    if isinstance(axis, SPMDAxisContext):
        return axis.mesh.size
    return 2
