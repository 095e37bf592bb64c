"""Transports: what an algorithm may ask of the network, and the implementations of it.

Every algorithm of :mod:`sparcml_jax.collectives` is written once, against :class:`Transport`.
Its operations are collective and SPMD: every rank makes the same calls with the same
arguments, and rank-dependent choices (who sends to whom, which range a rank owns) are the
transport's. A transport interprets them:

- ``native`` (:mod:`.native`) records them as a program that our C engine runs in one FFI call,
  on the calling thread or on the progress engine's thread; messages carry only valid entries;
- ``mpi4jax`` (:mod:`.mpi4jax_transport`) turns them into mpi4jax ops on static buffers;
- ``xla`` (:mod:`.xla_transport`) turns them into XLA's collectives over a mesh axis, inside
  ``jax.shard_map``, on static buffers;
- the cost model (:mod:`sparcml_jax.collectives.cost_model`) prices them;
- :mod:`.simulated` runs them for every rank at once in numpy, counting the bytes each sends.

Streams between operations are the transport's own values (a register, a ``SparseStream``, an
estimate); algorithms only pass them on.
"""

from __future__ import annotations

import itertools
from typing import Any, Literal, Protocol, Sequence, TypeVar

from mpi4py import MPI

S = TypeVar("S")
Combine = Literal["add", "replace"]


class Quantize(Protocol):
    bits: int
    bucket_size: int
    scale: str


class Transport(Protocol[S]):
    """The operations of the SparCML algorithms, as every rank calls them.

    Attributes:
      name: the transport's name, as ``transport=`` takes it.
      variable_length: messages carry only their valid entries (else whole static buffers).
      nonblocking: can run a whole algorithm between a start and a wait.
      nprocs: ranks taking part.
      size: length of the vector being reduced.
      delta: SparCML's dense switch: a stream of N entries is dense once ``8 nnz >= delta 4 N``.
      value_bits: bits of a value on the wire: 32, or 16 for bfloat16, which :meth:`allreduce`
        (MPI's sum) cannot carry.
    """

    name: str
    variable_length: bool
    nonblocking: bool
    nprocs: int
    size: int
    delta: float
    value_bits: int

    def exchange(self, s: S, pairs: Sequence[tuple[int, int]], *, combine: Combine, keep: bool = True) -> S:
        """Every (source, dest) pair: ``source`` sends its stream to ``dest``, which adds it to
        its own or replaces its own with it. Ranks in no pair keep theirs; with ``keep=False`` a
        rank that sends is left with what it receives, or an empty stream (it handed its over)."""

    def ring_pass(self, segments: list[S], *, send: int, into: int, combine: Combine) -> list[S]:
        """Rank r sends ``segments[(r + send) % P]`` to rank r + 1 and combines what rank r - 1
        sends into ``segments[(r + into) % P]`` (so ``send == into + 1``)."""

    def reduce_scatter(self, s: S, *, dense: bool = False, quantize: Quantize | None = None,
                       feedback: bool = False) -> S | tuple[S, S]:
        """Rank r gets the sum of range r of every rank's stream (indices local to the range): a
        stream, or with ``dense`` the range's dense values. With ``dense`` and ``quantize``, a segment that
        travels as dense values travels as their QSGD codes (the receiver decodes them and sums in
        float32); pairs and a rank's own segment stay exact. Transports of whole static buffers
        code every segment whose buffer could hold its range dense, whatever its count at run
        time (a message of fixed size cannot shrink to the codes only when it fills). With
        ``feedback``, also this rank's coding error: a dense stream over the whole vector of
        each coded segment's values minus what its owner decodes, zeros elsewhere."""

    def allgather(self, part: S, *, dense: bool = False, quantize: Quantize | None = None,
                  width: int | None = None) -> S:
        """The concatenation of every rank's part of :meth:`reduce_scatter`: the whole vector as a
        stream, or as dense values (``dense``), optionally QSGD-coded on the wire (``quantize``).
        With ``width``, of the selected parts of this rank's team of ``width`` consecutive ranks
        (range q of ``width`` ranges from the rank at position q)."""

    def allreduce(self, s: S) -> S:
        """The dense sum of every rank's stream (MPI_Allreduce)."""

    def gather(self, s: S, *, width: int | None = None) -> S:
        """The sum of every rank's whole stream, each sent to every rank; with ``width``, of the
        ranks at this rank's position in every team of ``width`` consecutive ranks."""

    def split(self, s: S, *, fan_in: int = 1, parts: int | None = None) -> list[S]:
        """This rank's stream cut into the P ranges (or ``parts`` ranges; indices local to each),
        each with room for the sum of ``fan_in`` such segments."""

    def concat(self, segments: list[S]) -> S:
        """This rank's segments over ``len(segments)`` consecutive ranges, joined into one stream."""

    # The global top-k algorithms (SparDL, gTop-k, Ok-Topk) re-select inside the collective.
    # Ok-Topk's thresholds and region starts are run-time values, in the transport's own form.

    def select(self, s: S, k: int, *, threshold: Any = None) -> tuple[S, S]:
        """(The ``min(k, entries)`` entries of ``s`` of largest magnitude as sorted pairs, ties to
        the lower index as in :func:`sparcml_jax.topk`; the rest of ``s``, in its representation.)
        With a ``threshold`` (this rank's), only the nonzero entries of at least its magnitude:
        all of them when no more than ``k`` qualify, else the top ``k``."""

    def add(self, a: S, b: S) -> S:
        """``a + b`` on this rank, in ``a``'s capacity (which must hold the sum)."""

    def split_regions(self, s: S, starts: Any) -> list[S]:
        """This rank's stream cut into P regions at the run-time ``starts`` of regions 1..P-1
        (int32[P - 1], identical on every rank), each segment keeping its indices over the whole
        vector (Ok-Topk's balanced regions)."""

    def pass_blocks(self, blocks: list[S], *, distance: int, count: int,
                    budgets: Sequence[int] | None = None) -> list[S]:
        """One round of SparDL's Spar-Reduce-Scatter among teams of B = ``len(blocks)``
        consecutive ranks, block q belonging to the rank at position q of its team. The rank at
        position q sends the top ``budgets[b]`` entries of each of its blocks b = q + distance + j
        (j < ``count``, mod B) to the rank at q + distance and keeps the rest in them; it adds
        what the rank at q - distance sends into its blocks q + j. Without ``budgets`` the blocks
        are handed over whole (and left empty)."""

    def select_owned(self, blocks: list[S], budgets: Sequence[int], *, threshold: Any = None) -> tuple[S, list[S]]:
        """(The top ``budgets[q]`` entries of this rank's own block q, as :meth:`select` takes
        them, as a part for :meth:`allgather`; the blocks with the rest left in the owned one.)"""

    def reselect_across_teams(self, part: S, budgets: Sequence[int]) -> S:
        """SparDL's Spar-All-Gather: the ranks at this rank's position q in every team of
        ``len(budgets)`` ranks sum their parts (:meth:`gather`) and keep the top ``budgets[q]`` of
        the sum, as :meth:`select` takes them, as a part for :meth:`allgather` in each team."""

    def residual(self, x: S, held: S, total: S) -> S:
        """SparDL's global residual collection: ``held`` where ``total`` is nonzero and ``x``
        elsewhere, as a dense stream."""


# Transports whose messages carry whole static buffers (priced by their capacities).
STATIC_BUFFER_TRANSPORTS = ("mpi4jax", "xla")


def transport_names() -> tuple[str, ...]:
    """The MPI transports (``comm=``); a mesh axis (``axis_name=``) has the ``"xla"`` one."""
    return ("native", "mpi4jax")


def check_transport(name: Any) -> str:
    if name not in transport_names():
        raise ValueError(f"transport must be one of {list(transport_names())}, got {name!r}")
    return name


def resolve_comm(comm: MPI.Comm | None) -> MPI.Comm:
    """``comm=None`` means mpi4jax's default communicator (a clone of COMM_WORLD), as in mpi4jax."""
    if comm is None:
        from sparcml_jax.comm._compat import default_comm

        return default_comm()
    if not isinstance(comm, MPI.Intracomm):
        raise TypeError(f"comm must be an mpi4py intracommunicator (e.g. MPI.COMM_WORLD), got {type(comm).__name__}")
    return comm


_IDENTITY = MPI.Comm.Create_keyval()  # not copied by Dup: a duplicate is another communicator
_identities = itertools.count()


def communicator_id(comm: MPI.Comm) -> int:
    """A number naming ``comm`` while it exists, never given to another communicator.

    Per-communicator caches (compiled programs, ``auto``'s cost model) key on it rather than on
    the handle: MPI hands a freed communicator's handle to a later one, whose group may differ.
    The native engine caches its channels the same way, as an attribute of the communicator.
    """
    identity = comm.Get_attr(_IDENTITY)
    if identity is None:
        identity = next(_identities)
        comm.Set_attr(_IDENTITY, identity)
    return identity
