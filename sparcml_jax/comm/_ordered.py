"""Communicating FFI calls as JAX primitives on mpi4jax's ordered effect.

XLA:CPU runs independent custom calls concurrently and out of program order, and
``has_side_effect=True`` does not order them (measured: 120/120 messages cross-matched). What
orders them is a token threaded through every MPI call. mpi4jax threads one token chain per
program through its ordered effect; our calls join the SAME effect object, because two chains
order each call only against its own kind and deadlock when mixed (see design.md).

A call bound with ``ordered=False`` carries no effect: a program whose only MPI call it is then
takes JAX's C++ dispatch path instead of the Python one that every effect forces (which handles
each argument and result one by one: about 1 ms for a small CNN's train step with Adam). It is
ordered against the programs before and after it by the CPU client, which runs a device's
programs in the order they were dispatched; nothing orders it against another MPI call of the
same program, so it must be the only one. Lowering rejects a second unordered call lowered into
a module, one in a program with ordered effects and one in a program over several devices;
:func:`comm.native.unordered_call` rejects a second one as it is traced (JAX lowers a jitted
function called twice only once).
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
import numpy as np
from jax.extend.core import Primitive
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo
from jax.interpreters import mlir

from sparcml_jax import _lib
from sparcml_jax.comm._compat import abstract_token, apply_primitive, lowered_for_devices, ordered_effect

ORDERED_EFFECT = ordered_effect

AvalsFn = Callable[..., Sequence[jax.core.ShapedArray]]


def ordered_ffi_primitive(
    name: str, target: str, symbol: str, result_avals: AvalsFn, shape_params: Sequence[str] = ()
) -> Primitive:
    """A primitive whose CPU lowering calls FFI ``target`` with a token on the shared chain.

    ``result_avals(*operand_avals, **params)`` gives the (static) result shapes. Params named in
    ``shape_params`` only shape the results; all others are passed to the handler as attributes,
    so they must be numpy scalars of the handler's type, strings, or tuples of ints (int64 arrays).
    The param ``ordered=False`` binds a call without the effect (see the module's docstring).
    """
    prim = Primitive(name)
    prim.multiple_results = True

    def abstract_eval(*avals, ordered=True, **params):
        return list(result_avals(*avals, **params)), {ORDERED_EFFECT} if ordered else set()

    def lowering(ctx, *operands, ordered=True, **params):
        _lib.register_cpu_target(target, symbol, library="mpi")
        if not ordered:
            _check_alone(ctx.module_context, name)
        token = ctx.tokens_in.get(ORDERED_EFFECT) if ordered else stablehlo.create_token()
        sub = ctx.replace(
            avals_in=(*ctx.avals_in, abstract_token), avals_out=(*ctx.avals_out, abstract_token)
        )
        # Params must be hashable, so array attributes travel as tuples of ints.
        attrs = {k: np.asarray(v, np.int64) if isinstance(v, tuple) else v
                 for k, v in params.items() if k not in shape_params}
        *results, token = jax.ffi.ffi_lowering(target, has_side_effect=True)(sub, *operands, token, **attrs)
        if ordered:
            ctx.set_tokens_out(mlir.TokenSet({ORDERED_EFFECT: token}))
        return results

    prim.def_impl(functools.partial(apply_primitive, prim))
    prim.def_effectful_abstract_eval(abstract_eval)
    mlir.register_lowering(prim, lowering, platform="cpu")
    return prim


_UNORDERED_MARK = "sparcml_jax.unordered_call"


def _check_alone(module_context, name: str) -> None:
    """Raises, as the program is lowered (the same on every rank), where nothing would order an
    unordered call: beside another one lowered into the same module, in a program with ordered
    effects (mpi4jax's MPI calls, this package's ordered ones, ordered callbacks), whose main
    function then takes JAX's token arguments, or in a program over several devices (one call
    per device, at once)."""
    if lowered_for_devices(module_context) > 1:
        raise ValueError(f"{name}: an MPI call without JAX's ordered effect (ordered=False) in a program over several "
                         "devices would run once per device, unordered: run it in a single-device program, or pass "
                         "ordered=True")
    module = module_context.module
    attributes = module.operation.attributes
    if _UNORDERED_MARK in attributes:
        raise ValueError(f"{name}: a program makes two MPI calls without JAX's ordered effect (ordered=False), and "
                         "nothing would order them: give each its own jitted program, or pass ordered=True")
    attributes[_UNORDERED_MARK] = ir.UnitAttr.get()
    for op in module.body.operations:
        if "sym_name" not in op.attributes or ir.StringAttr(op.attributes["sym_name"]).value != "main":
            continue
        arguments = ir.ArrayAttr(op.attributes["arg_attrs"]) if "arg_attrs" in op.attributes else []
        if any("jax.token" in ir.DictAttr(a) for a in arguments):
            raise ValueError(f"{name}: a program mixes an MPI call without JAX's ordered effect (ordered=False) with "
                             "calls on ordered effects (mpi4jax's MPI calls, this package's ordered ones, ordered "
                             "callbacks), and nothing would order the two: move those to a jitted program of their "
                             "own, or pass ordered=True")


def i64(x: int) -> np.int64:
    return np.int64(x)
