"""Native transport: our own MPI engine in C (ffi/bindings), which sends only the valid entries.

An algorithm runs here once per trace and records what it asks of the transport as a program of
fixed-width instructions over stream registers (``ffi/bindings/mpi_program.h``). One FFI call
then runs the whole program: :func:`run` on the calling thread, or :func:`start` on the progress
engine's thread until :func:`wait`. Blocking and non-blocking calls execute the same program.

Every message starts with a header that carries the call's signature hash and error flags
(``ffi/bindings/mpi_wire.h``): agreement and validation ride on the algorithm's own messages.
Only a collective MPI call (the dense allreduce; the dense allgather when nothing before it
heard from every rank) and a choice on the global count need a step of their own first.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import ctypes
import dataclasses
import functools
import hashlib
import os
import struct
import sys
import time
import weakref
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

from sparcml_jax import _lib
from sparcml_jax.comm import Combine, Quantize
from sparcml_jax.comm._compat import enclosing_traces
from sparcml_jax.comm._ordered import i64, ordered_ffi_primitive
from sparcml_jax.comm.topology import (allgather_capacities, block_pass, check_pairs, concatenated_capacity,
                                       exchange_capacity, grown_capacity, owned_slot, part_capacity, part_length,
                                       passed_capacity, peers_of, ring_segments, segment_capacities,
                                       selected_capacity)
from sparcml_jax.stream import INDEX_DTYPE, VALUE_DTYPE, SparseStream

NAME = "native"
# Instruction words {op, dst, capacity, a, b, c, d, e}: keep in step with ffi/bindings/mpi_program.h.
WORDS = 8
(EXCHANGE, REDUCE_SCATTER, ALLGATHER, ALLREDUCE, SPLIT, CONCAT, GATHER, AGREE, CHOOSE, MOVE, FREE, SELECT, ADD_LOCAL,
 RESIDUAL, NONZEROS, WIRE) = range(1, 17)
COUNT_AND_COMPACT, COUNT_ONLY, COMPACT_COUNTED = 0, 1, 2  # NONZEROS' steps
COMBINE = {"add": 1, "replace": 2}
HAND_OVER, PAIRS_ONLY = 4, 8
PAIRS, DENSE_SLICES, QUANTIZED, SELECTED_PAIRS, REGION_PAIRS = 0, 1, 2, 3, 4
SCALES = {"max": 0, "l2": 1}
# How long exit waits for reductions in flight (their peers must run them too).
EXIT_TIMEOUT_ENV = "SPARCML_JAX_EXIT_TIMEOUT"
SIGNATURE_FIELDS = 16  # fixed: every rank's diagnosis gathers the same number of values

_ShapedArray = jax.core.ShapedArray


@dataclasses.dataclass(frozen=True)
class Register:
    """A stream of the program being recorded: static on this rank.

    Attributes:
      id: the register's number.
      size: length of its index space (a range's length for a part of a reduce-scatter).
      capacity: its static capacity.
      source_capacity: for a part, the capacity of the stream it was reduced from (-1 otherwise).
      slot: for a selected part, the pairs every rank's part has room for (-1 otherwise).
      regions: a segment of :meth:`Recorder.split_regions` (its indices over the whole vector).
      dense: dense by construction (a dense allreduce's or allgather's result): no index buffer.
    """

    id: int
    size: int
    capacity: int
    source_capacity: int = -1
    slot: int = -1
    regions: bool = False
    dense: bool = False


@dataclasses.dataclass(frozen=True)
class Operand:
    """A run-time operand of a program (a threshold's float bits, or the first of the region
    starts): word ``index`` of the operands that :func:`run_global_topk` passes."""

    index: int


@dataclasses.dataclass(frozen=True)
class Program:
    """A recorded algorithm: its instructions, and where its result is (``result`` -1: none)
    and a global top-k's residual (``residual`` -1: none). A ``dense`` result is dense by
    construction: it comes back without an index buffer."""

    code: tuple[int, ...]
    result: int
    size: int
    capacity: int
    algorithm: int = -1  # ALGORITHMS code; -1 when the program chooses (then it reports its choice)
    residual: int = -1
    dense: bool = False

    @property
    def index_capacity(self) -> int:
        return 0 if self.dense or self.result < 0 else self.capacity


class Recorder:
    """The native :class:`~sparcml_jax.comm.Transport`: records each operation as an instruction."""

    name = NAME
    variable_length = True
    nonblocking = True

    def __init__(self, rank: int, nprocs: int, delta: float, size: int, counter: list[int] | None = None,
                 value_bits: int = 32):
        self.rank, self.nprocs, self.delta, self.size, self.value_bits = rank, nprocs, delta, size, value_bits
        self.code: list[int] = []
        self._counter = counter if counter is not None else [1]  # register 0 is the input

    def _new(self, size: int, capacity: int, **fields: int) -> Register:
        reg = Register(self._counter[0], size, capacity, **fields)
        self._counter[0] += 1
        return reg

    def emit(self, op: int, dst: int = 0, capacity: int = 0, *args: int) -> None:
        self.code += [op, dst, capacity, *args, *[0] * (WORDS - 3 - len(args))]

    def exchange(self, s: Register, pairs: Sequence[tuple[int, int]], *, combine: Combine,
                 keep: bool = True) -> Register:
        check_pairs(pairs, self.nprocs)
        dest, source = peers_of(pairs, self.rank)
        out = self._new(s.size, exchange_capacity(s.capacity, s.size, combine, self.delta))
        self.emit(EXCHANGE, out.id, out.capacity, s.id, s.id, dest, source, COMBINE[combine] | (0 if keep else HAND_OVER))
        return out

    def ring_pass(self, segments: list[Register], *, send: int, into: int, combine: Combine) -> list[Register]:
        p, r = self.nprocs, self.rank
        sending, into_index = ring_segments(r, p, send, into)
        target = segments[into_index]
        out = self._new(target.size, target.capacity)
        self.emit(EXCHANGE, out.id, out.capacity, segments[sending].id, target.id, (r + 1) % p, (r - 1) % p,
                  COMBINE[combine])
        return [out if j == into_index else seg for j, seg in enumerate(segments)]

    def reduce_scatter(self, s: Register, *, dense: bool = False, quantize: Quantize | None = None,
                       feedback: bool = False) -> Register | tuple[Register, Register]:
        length = part_length(s.size, self.nprocs, self.rank)
        capacity = length if dense else part_capacity(s.capacity, s.size, self.nprocs, self.rank, self.delta)
        out = self._new(length, capacity, source_capacity=s.capacity)
        error = self._new(s.size, s.size, dense=True) if feedback else None
        coding = (0, 0, 0) if quantize is None else (quantize.bits, quantize.bucket_size, SCALES[quantize.scale])
        self.emit(REDUCE_SCATTER, out.id, capacity, s.id, int(dense) | (0 if error is None else error.id + 1) << 1,
                  *coding)
        return out if error is None else (out, error)

    def allgather(self, part: Register, *, dense: bool = False, quantize: Quantize | None = None,
                  width: int | None = None) -> Register:
        n = self.size
        if quantize is not None:
            out = self._new(n, n, dense=True)
            self.emit(ALLGATHER, out.id, n, part.id, QUANTIZED, quantize.bits, quantize.bucket_size,
                      SCALES[quantize.scale])
        elif dense:
            out = self._new(n, n, dense=True)
            self.emit(ALLGATHER, out.id, n, part.id, DENSE_SLICES)
        else:
            parts = self.nprocs if width is None else width
            _, capacity = allgather_capacities(part.source_capacity, part.slot, n, parts, self.delta)
            out = self._new(n, capacity)
            mode = REGION_PAIRS if part.regions else SELECTED_PAIRS if part.source_capacity < 0 else PAIRS
            self.emit(ALLGATHER, out.id, out.capacity, part.id, mode, 0 if width is None else width)
        return out

    def allreduce(self, s: Register) -> Register:
        out = self._new(s.size, s.size, dense=True)
        self.emit(ALLREDUCE, out.id, out.capacity, s.id)
        return out

    def gather(self, s: Register, *, width: int | None = None) -> Register:
        fan_in = self.nprocs if width is None else self.nprocs // width
        out = self._new(s.size, grown_capacity(s.capacity, s.size, fan_in, self.delta))
        self.emit(GATHER, out.id, out.capacity, s.id, 0 if width is None else width)
        return out

    def split(self, s: Register, *, fan_in: int = 1, parts: int | None = None) -> list[Register]:
        parts = self.nprocs if parts is None else parts
        capacities = segment_capacities(s.capacity, s.size, parts, fan_in, self.delta)
        segments = [self._new(part_length(s.size, parts, r), c) for r, c in enumerate(capacities)]
        self.emit(SPLIT, segments[0].id, s.capacity, s.id, 0, parts)
        return segments

    def concat(self, segments: list[Register]) -> Register:
        # The engine reads the segments from consecutive registers.
        block = [self._new(seg.size, seg.capacity) for seg in segments]
        for seg, to in zip(segments, block):
            self.emit(MOVE, to.id, to.capacity, seg.id)
        out = self._new(self.size, concatenated_capacity([seg.capacity for seg in segments], self.size, self.delta))
        self.emit(CONCAT, out.id, out.capacity, block[0].id, len(segments))
        return out

    def select(self, s: Register, k: int, *, threshold: Operand | None = None, **part: Any) -> tuple[Register, Register]:
        kept = self._new(s.size, selected_capacity(k, s.capacity, s.size), **part)
        rest = self._new(s.size, s.capacity)
        self.emit(SELECT, kept.id, kept.capacity, s.id, rest.id, 0 if threshold is None else threshold.index + 1)
        return kept, rest

    def split_regions(self, s: Register, starts: Operand) -> list[Register]:
        segments = [self._new(s.size, min(s.capacity, s.size), regions=True) for _ in range(self.nprocs)]
        self.emit(SPLIT, segments[0].id, s.capacity, s.id, starts.index + 1)
        return segments

    def add(self, a: Register, b: Register) -> Register:
        out = self._new(a.size, a.capacity)
        self.emit(ADD_LOCAL, out.id, out.capacity, a.id, b.id)
        return out

    def pass_blocks(self, blocks: list[Register], *, distance: int, count: int,
                    budgets: Sequence[int] | None = None) -> list[Register]:
        out = list(blocks)
        dest, source, moves = block_pass(self.rank, len(blocks), distance, count)
        for send, into in moves:
            if budgets is None:
                kept = out[send]
            else:
                kept, out[send] = self.select(out[send], budgets[send])
            target = out[into]
            capacity = passed_capacity(target.capacity, kept.capacity, target.size, budgets is None)
            out[into] = self._new(target.size, capacity, regions=target.regions)
            self.emit(EXCHANGE, out[into].id, capacity, kept.id, target.id, dest, source,
                      COMBINE["add"] | (PAIRS_ONLY if target.regions else 0))
            if budgets is None:  # handed over whole
                self.emit(FREE, 0, 0, kept.id)
        return out

    def select_owned(self, blocks: list[Register], budgets: Sequence[int], *,
                     threshold: Operand | None = None) -> tuple[Register, list[Register]]:
        width, out = len(blocks), list(blocks)
        slot = owned_slot(budgets, [(b.capacity, b.size) for b in blocks])
        own = self.rank % width
        part, out[own] = self.select(out[own], budgets[own], threshold=threshold, source_capacity=-1, slot=slot,
                                     regions=out[own].regions)
        return part, out

    def reselect_across_teams(self, part: Register, budgets: Sequence[int]) -> Register:
        width = len(budgets)
        summed = self.gather(part, width=width)
        kept, _ = self.select(summed, budgets[self.rank % width], source_capacity=-1, slot=part.slot)
        return kept

    def residual(self, x: Register, held: Register, total: Register) -> Register:
        out = self._new(x.size, x.size)
        self.emit(RESIDUAL, out.id, out.capacity, x.id, held.id, total.id)
        return out


def _program_recorder(rank: int, nprocs: int, delta: float, size: int, counter: list[int],
                      value_bits: int) -> Recorder:
    """The recorder of a whole program. On a bfloat16 wire its first instruction makes every
    message carry its values as bfloat16 (rounded to nearest even; sums stay float32), and a rank
    keeps what it sends as its peers receive it, so every rank ends with the same result."""
    rec = Recorder(rank, nprocs, delta, size, counter, value_bits)
    if value_bits == 16:
        rec.emit(WIRE, 0, 0, 16)
    return rec


def record(algorithm: Callable[..., Register], *, rank: int, nprocs: int, delta: float, size: int, capacity: int,
           code: int, value_bits: int = 32, **options: Any) -> Program:
    """Records ``algorithm(transport, stream, **options)`` for this rank (a global top-k returns
    its result and its residual), its values on a wire of ``value_bits`` (32, or 16: bfloat16)."""
    rec = _program_recorder(rank, nprocs, delta, size, [1], value_bits)
    out = algorithm(rec, Register(0, size, capacity), **options)
    out, residual = out if isinstance(out, tuple) else (out, None)
    return Program(tuple(rec.code), out.id, size, out.capacity, code, -1 if residual is None else residual.id,
                   out.dense)


def record_choice(choices: Sequence[tuple[int, int, Callable[..., Register], dict]], *, rank: int, nprocs: int,
                  delta: float, size: int, capacity: int, nonzeros: bool = False, value_bits: int = 32) -> Program:
    """A program that agrees on the largest nnz over ranks, then runs the first of ``choices``
    ((bound, code, algorithm, options)) whose bound covers it; the result has the largest capacity.

    With ``nonzeros`` the input is a dense vector (as in :func:`on_nonzeros`), counted before the
    agreement and compacted only in a branch other than the dense allreduce (code 0), which sums
    it as it lies; the result is its n dense values."""
    counter = [1]
    rec = _program_recorder(rank, nprocs, delta, size, counter, value_bits)
    if nonzeros:
        rec.emit(NONZEROS, 0, capacity, 0, COUNT_ONLY)
    rec.emit(AGREE, 0, 0, 0)
    branches = []
    for bound, code, algorithm, options in choices:
        sub = Recorder(rank, nprocs, delta, size, counter, value_bits)
        if nonzeros and code != 0:
            sub.emit(NONZEROS, 0, capacity, 0, COMPACT_COUNTED)
        out = algorithm(sub, Register(0, size, capacity), **options)
        out, residual = out if isinstance(out, tuple) else (out, None)
        branches.append((bound, code, sub, out, residual))
    dense = nonzeros or all(out.dense for *_, out, _ in branches)
    width = size if nonzeros else max(out.capacity for *_, out, _ in branches)
    result = Register(counter[0], size, width, dense=dense)
    # A branch without a residual (an exact algorithm beside quantized DSAR) leaves it zero.
    residual = Register(counter[0] + 1, size, size, dense=True) if any(b[-1] for b in branches) else None
    rec.emit(CHOOSE, 0, 0, len(branches))
    for bound, code, sub, out, own in branches:
        if own is not None:
            sub.emit(MOVE, residual.id, residual.capacity, own.id)
        sub.emit(MOVE, result.id, result.capacity, out.id)  # last: the engine writes it in place
        rec.code += [bound, code, len(sub.code) // WORDS, 0, 0, 0, 0, 0]
    for _, _, sub, _, _ in branches:
        rec.code += sub.code
    return Program(tuple(rec.code), result.id, size, result.capacity, -1, -1 if residual is None else residual.id,
                   dense=dense)


def on_nonzeros(program: Program) -> Program:
    """``program`` (of one algorithm) run on a dense vector's nonzeros, with its sum as n dense
    values.

    The input is a stream dense by construction (its n values); the engine first turns it into
    what :func:`~sparcml_jax.from_dense` would build at capacity n, counting it and compacting it
    only when its count is below the dense threshold.
    """
    size = program.size
    return dataclasses.replace(program, code=(NONZEROS, 0, size, 0, COUNT_AND_COMPACT, 0, 0, 0) + program.code,
                               capacity=size, dense=True)


# ----------------------------------------------------------------------------- signatures


@dataclasses.dataclass(frozen=True)
class Signature:
    """A call's static choices as ranks compare them: named int64 fields and their hash."""

    fields: tuple[int, ...]
    names: str
    hash: int

    @classmethod
    def of(cls, collective: str | None, **fields: Any) -> "Signature":
        """``collective=None`` is a rejected call (its rank raised on its arguments)."""
        values = {"argument error": 0 if collective else 1,
                  "collective": {"allreduce": 1, "allgather": 2, "calibrate": 3, "global_topk": 4,
                                 None: -1}[collective]}
        for name, value in fields.items():
            if isinstance(value, float):
                value = struct.unpack("<q", struct.pack("<d", value))[0]
            elif isinstance(value, str):
                value = int.from_bytes(value.encode()[:7].ljust(7, b"\0"), "little")
            values[name] = -1 if value is None else int(value)
        if len(values) > SIGNATURE_FIELDS:
            raise ValueError(f"a signature holds at most {SIGNATURE_FIELDS} fields, got {len(values)}")
        values.update({f"unused {i}": 0 for i in range(len(values), SIGNATURE_FIELDS)})
        packed = np.asarray(list(values.values()), np.int64).tobytes()
        digest = int.from_bytes(hashlib.blake2b(packed, digest_size=8).digest(), "little", signed=True)
        return cls(tuple(values.values()), ",".join(values), digest)


# ----------------------------------------------------------------------------- FFI calls


def _results(capacity: int, index_capacity: int, value_dtype: str):
    """The result buffers; its values are float32 or, for a bfloat16 caller, bfloat16 (the engine
    sums in float32 and rounds the result on the way out)."""
    return [_ShapedArray((index_capacity,), INDEX_DTYPE), _ShapedArray((capacity,), jnp.dtype(value_dtype)),
            _ShapedArray((), INDEX_DTYPE), _ShapedArray((), INDEX_DTYPE), _ShapedArray((), VALUE_DTYPE),
            _ShapedArray((), INDEX_DTYPE)]


_run_p = ordered_ffi_primitive(
    "sparcml_run", "sparcml_mpi_run", "SparcmlMpiRun",
    lambda *avals, capacity, index_capacity, residual_size, value_dtype, **_: [
        *_results(int(capacity), int(index_capacity), value_dtype), _ShapedArray((int(residual_size),), VALUE_DTYPE)],
    shape_params=("capacity", "index_capacity", "residual_size", "value_dtype"))
_start_p = ordered_ffi_primitive("sparcml_engine_start", "sparcml_engine_start", "SparcmlEngineStart",
                                 lambda *avals, **_: [_ShapedArray((), INDEX_DTYPE)])
_wait_p = ordered_ffi_primitive("sparcml_engine_wait", "sparcml_engine_wait", "SparcmlEngineWait",
                                lambda job, *after, capacity, index_capacity: _results(
                                    int(capacity), int(index_capacity), jnp.dtype(VALUE_DTYPE).name),
                                shape_params=("capacity", "index_capacity"))


def _attributes(program: Program, comm: MPI.Comm, signature: Signature, delta: float, rejected: bool) -> dict:
    return dict(comm=i64(comm.py2f()), n=i64(program.size), delta=float(delta), program=program.code,
                result=i64(program.result), algorithm=i64(program.algorithm), signature=signature.fields,
                hash=i64(signature.hash), fields=signature.names, rejected=i64(int(rejected)))


# Whether the collectives called now run unordered (inside unordered_calls()).
_UNORDERED: contextvars.ContextVar[bool] = contextvars.ContextVar("sparcml_jax_unordered", default=False)
# The traces that hold an unordered call already.
_TRACES_WITH_ONE: weakref.WeakSet = weakref.WeakSet()


@contextlib.contextmanager
def unordered_calls():
    """Within it, the collectives called run their native program unordered (``ordered=False``,
    see ``comm._ordered``), so a program whose only MPI call is one of them takes JAX's C++
    dispatch path."""
    reset = _UNORDERED.set(True)
    try:
        yield
    finally:
        _UNORDERED.reset(reset)


def unordered_call(name: str) -> bool:
    """Whether a collective called now runs unordered. Raises for a second one in the traces it
    is staged into (the enclosing ones included: a loop's body and the code around the loop are
    one program); lowering rejects the rest (``comm._ordered``)."""
    if not _UNORDERED.get():
        return False
    traces = enclosing_traces()
    if any(trace in _TRACES_WITH_ONE for trace in traces):
        raise ValueError(f"{name}: a second MPI call without JAX's ordered effect (ordered=False) in one program, "
                         "and nothing would order the two: make them one collective (fuse=True, the default, and "
                         "no second transform in the step), give each its own jitted program, or pass "
                         "ordered=True")
    _TRACES_WITH_ONE.update(traces)
    return True


@functools.cache
def _drain_at_exit() -> None:
    # Registered after mpi4py's import, so it runs before MPI_Finalize. jax.effects_barrier()
    # waits only for programs with effects; a CPU device runs programs in dispatch order, so
    # one more program on it is done only when every earlier one is.
    def drain():
        for device in jax.local_devices():
            jax.block_until_ready(jax.jit(lambda x: x + 1)(jax.device_put(jnp.zeros(()), device)))

    atexit.register(drain)


def _key_or_zeros(key_words):
    return jnp.zeros((2,), jnp.uint32) if key_words is None else key_words


def run(program: Program, s: SparseStream, *, comm: MPI.Comm, signature: Signature, delta: float,
        key_words: jax.Array | None = None, rejected: bool = False):
    """Runs ``program`` on this rank's stream, on the calling thread. Returns (result, algorithm
    code, bytes sent, dense round); for a program without a result, the result's nnz is the
    largest nnz over ranks and its buffers are empty."""
    result, algorithm, sent, dense_round, _ = _bind_run(program, s, comm, signature, delta, key_words, rejected)
    return result, algorithm, sent, dense_round


def run_with_residual(program: Program, s: SparseStream | jax.Array, *, comm: MPI.Comm, signature: Signature,
                      delta: float, key_words: jax.Array | None = None, divisor: int = 1, ordered: bool = True):
    """:func:`run`, and the program's dense residual (empty when it has none) last. ``s`` may be
    a dense vector instead of a stream, float32 or bfloat16: the engine widens bfloat16 values as
    it reads them, sums in float32, and writes the result's values as bfloat16, rounded to
    nearest even (its residual stays float32). The result's values are divided by ``divisor``
    (in float32, before that rounding). ``ordered=False``: the call carries no effect (see
    ``comm._ordered``)."""
    return _bind_run(program, s, comm, signature, delta, key_words, False, divisor, ordered)


def run_global_topk(program: Program, x: SparseStream, *, comm: MPI.Comm, signature: Signature, delta: float,
                    operands: jax.Array | None = None):
    """Runs a global top-k's ``program`` on this rank's dense input, with its run-time
    ``operands`` (uint32 words, see :class:`Operand`). Returns (result, this rank's dense
    residual, bytes sent)."""
    words = None if operands is None else jnp.concatenate([jnp.zeros((2,), jnp.uint32), operands])
    result, _, sent, _, residual = _bind_run(program, x, comm, signature, delta, words, False)
    return result, residual, sent


def _bind_run(program: Program, s: SparseStream | jax.Array, comm, signature, delta, key_words, rejected,
              divisor: int = 1, ordered: bool = True):
    capacity = program.capacity if program.result >= 0 else 0
    if not isinstance(s, SparseStream):  # a dense vector: the stream dense by construction, in its own dtype
        s = _DenseVector(jnp.zeros((0,), INDEX_DTYPE), s, jnp.asarray(s.shape[0], INDEX_DTYPE), s.shape[0])
    if not ordered:
        _drain_at_exit()
    idx, val, nnz, algorithm, sent, dense_round, residual = _run_p.bind(
        s.indices, s.values, s.nnz, _key_or_zeros(key_words), capacity=i64(capacity),
        index_capacity=i64(program.index_capacity),
        residual_size=i64(program.size if program.residual >= 0 else 0), residual=i64(program.residual),
        value_dtype=s.values.dtype.name, divisor=float(divisor), ordered=ordered,
        **_attributes(program, comm, signature, delta, rejected))
    result = (SparseStream if val.dtype == VALUE_DTYPE else _DenseVector)(idx, val, nnz, program.size)
    return result, algorithm, sent, dense_round, residual


class _DenseVector(NamedTuple):
    """A stream's buffers whose values a SparseStream cannot hold (bfloat16)."""

    indices: jax.Array
    values: jax.Array
    nnz: jax.Array
    size: int


def agree(s: SparseStream, *, comm: MPI.Comm, signature: Signature, rejected: bool = False) -> jax.Array:
    """Ranks compare ``signature`` and validate their streams (a mismatch or an invalid stream
    raises on every rank). Returns the largest nnz over ranks."""
    program = Program((AGREE, 0, 0, 0, 0, 0, 0, 0), -1, s.size, 0)
    return run(program, s, comm=comm, signature=signature, delta=1.0, rejected=rejected)[0].nnz


def start(program: Program, s: SparseStream, *, comm: MPI.Comm, signature: Signature, delta: float,
          key_words: jax.Array | None = None, rejected: bool = False) -> jax.Array:
    """Submits ``program`` to the progress engine and returns the job's id (int32) at once."""
    _shutdown_at_exit()
    (job,) = _start_p.bind(s.indices, s.values, s.nnz, _key_or_zeros(key_words),
                           **_attributes(program, comm, signature, delta, rejected))
    return job


def wait(job: jax.Array, *, size: int, capacity: int, index_capacity: int | None = None, after=()):
    """Blocks until job ``job`` is done; returns (result, algorithm code, bytes sent, dense round).
    ``index_capacity`` (default ``capacity``) is 0 for a program whose result is dense by
    construction. The arrays of ``after`` become operands (unread), so XLA computes them before the wait."""
    index_capacity = capacity if index_capacity is None else index_capacity
    idx, val, nnz, algorithm, sent, dense_round = _wait_p.bind(job, *jax.tree.leaves(after), capacity=i64(capacity),
                                                               index_capacity=i64(index_capacity))
    return SparseStream(idx, val, nnz, size), algorithm, sent, dense_round


@functools.cache
def _shutdown_at_exit() -> None:
    # Registered after mpi4py's import, so it runs before MPI_Finalize.
    atexit.register(_shutdown)


def _shutdown() -> None:
    """Lets reductions still in flight finish (every rank runs them), then stops the engine.

    If they cannot finish, a peer never started its part: the job can only be ended by aborting,
    which beats hanging in MPI_Finalize.
    """
    lib = _lib.mpi_library()
    lib.SparcmlEngineShutdown.restype = int
    lib.SparcmlEngineShutdown.argtypes = [ctypes.c_double]
    timeout = float(os.environ.get(EXIT_TIMEOUT_ENV, "30"))
    if not lib.SparcmlEngineShutdown(timeout):
        print(f"sparcml_jax: a non-blocking allreduce was still in flight at exit and its peers did not complete "
              f"it within {timeout:g} s ({EXIT_TIMEOUT_ENV}); aborting the MPI job", file=sys.stderr, flush=True)
        time.sleep(0.5)  # lets mpiexec forward the message before the abort takes the job down
        MPI.COMM_WORLD.Abort(1)
