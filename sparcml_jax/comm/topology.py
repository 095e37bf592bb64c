"""Static schedules shared by the algorithms and both transports."""

from __future__ import annotations

import math

from sparcml_jax.kernels.partition import partition_bounds
from sparcml_jax.stream import can_switch_to_dense


def part_bounds(size: int, parts: int, r: int) -> tuple[int, int]:
    """Index range of part r (see :func:`sparcml_jax.kernels.partition.partition_bounds`)."""
    bounds = partition_bounds(size, parts)
    return int(bounds[r]), int(bounds[r + 1])


def part_length(size: int, parts: int, r: int) -> int:
    lo, hi = part_bounds(size, parts, r)
    return hi - lo


def longest_part(size: int, parts: int) -> int:
    """Length of the longest range: the slot a range travels in when message sizes are static."""
    return max(part_length(size, parts, r) for r in range(parts))


def segment_slot(capacity: int, size: int, parts: int) -> int:
    """Pairs of the slot a stream's segment of one range travels in when message sizes are
    static: the stream's capacity, but no more than the longest range."""
    return min(capacity, longest_part(size, parts))


def codes_segments(capacity: int, size: int, parts: int) -> bool:
    """Whether a quantized reduce-scatter on static buffers sends codes: once a segment's slot of
    pairs could hold its range's dense values (its fixed message is then no smaller than them)."""
    return 2 * segment_slot(capacity, size, parts) >= longest_part(size, parts)


def slices_segments(capacity: int, size: int, parts: int) -> bool:
    """Whether a reduce-scatter into dense ranges on static buffers with bfloat16 values sends
    each range's dense values: once a segment's slot of pairs (6 bytes each) could hold them (2 each)."""
    return 3 * segment_slot(capacity, size, parts) >= longest_part(size, parts)


def lower_power_of_two(p: int) -> int:
    return 1 << (p.bit_length() - 1)


def grown_capacity(capacity: int, size: int, fan_in: int, delta: float) -> int:
    """Capacity of the sum of ``fan_in`` streams of ``capacity``: the union bound, or ``size``
    once the sum may switch to the dense representation."""
    union = min(capacity * fan_in, size)
    return size if can_switch_to_dense(union, size, delta) else union


def part_capacity(capacity: int, size: int, parts: int, r: int, delta: float) -> int:
    """Capacity of part r after the reduce-scatter: P segments of at most min(capacity, L) pairs."""
    length = part_length(size, parts, r)
    return grown_capacity(min(capacity, length), length, parts, delta)


def largest_part_capacity(capacity: int, size: int, parts: int, delta: float) -> int:
    """The largest :func:`part_capacity` over the ranges: the slot every part travels in."""
    return max(part_capacity(capacity, size, parts, r, delta) for r in range(parts))


def gathered_capacity(capacity: int, size: int, parts: int, delta: float) -> int:
    """Capacity of the allgather result: the sum of the part capacities, but no more than the
    union of the inputs can fill. A part travels as its dense slice once its count reaches
    ceil(delta L / 2), so its L entries are at most 2 / delta times its count: the parts hold
    at most max(1, 2 / delta) times the union, which holds at most P times the capacity."""
    total = sum(part_capacity(capacity, size, parts, r, delta) for r in range(parts))
    union = grown_capacity(math.ceil(max(1.0, 2.0 / delta) * capacity), size, parts, delta)
    return grown_capacity(min(total, union), size, 1, delta)


def exchange_capacity(capacity: int, size: int, combine: str, delta: float) -> int:
    """Capacity after an exchange: the sum of two streams when adding, the sender's when replacing."""
    return grown_capacity(capacity, size, 2, delta) if combine == "add" else capacity


def segment_capacities(capacity: int, size: int, parts: int, fan_in: int, delta: float) -> list[int]:
    """Capacities of a stream's segments over the P ranges, each with room for the sum of
    ``fan_in`` such segments (a segment of a stream of capacity c over a range of L holds at
    most min(c, L) pairs)."""
    return [grown_capacity(min(capacity, part_length(size, parts, r)), part_length(size, parts, r), fan_in, delta)
            for r in range(parts)]


def concatenated_capacity(capacities, size: int, delta: float) -> int:
    """Capacity of the concatenation of streams over consecutive ranges of a length-``size`` vector."""
    return grown_capacity(sum(capacities), size, 1, delta)


def check_pairs(pairs, nprocs: int) -> None:
    """An exchange's (source, dest) pairs: ranks of the communicator, each a source and a dest at most once."""
    sources = [s for s, _ in pairs]
    dests = [d for _, d in pairs]
    bad = [r for r in sources + dests if not 0 <= r < nprocs]
    if bad or len(set(sources)) != len(sources) or len(set(dests)) != len(dests):
        raise ValueError(f"exchange pairs {list(pairs)} must name ranks in [0, {nprocs}), each at most once as a "
                         "source and once as a destination")


def peers_of(pairs, rank: int) -> tuple[int, int]:
    """(dest, source) of ``rank`` in an exchange's (source, dest) pairs; -1 where it has none."""
    dest = next((d for s, d in pairs if s == rank), -1)
    source = next((s for s, d in pairs if d == rank), -1)
    return dest, source


def ring_segments(rank: int, nprocs: int, send: int, into: int) -> tuple[int, int]:
    """(segment ``rank`` sends to rank + 1, segment it combines what rank - 1 sends into) in a
    ring pass: rank r + 1 combines what rank r sends, so ``send`` must be ``into + 1``."""
    if (send - into) % nprocs != 1 % nprocs:
        raise ValueError(f"ring_pass: rank r + 1 combines what rank r sends, so send must be into + 1 "
                         f"(got send={send}, into={into})")
    return (rank + send) % nprocs, (rank + into) % nprocs


def spar_reduce_scatter_rounds(blocks: int) -> list[tuple[int, int]]:
    """(distance, blocks sent) of each round of SparDL's Spar-Reduce-Scatter over ``blocks``
    ranks: n = ceil(log2 B) rounds that send B - 2^(n-1), 2^(n-2), ..., 2, 1 blocks (B - 1 in
    all) at distances 2^(n-1), 2^(n-2), ..., 1. Any B, no folding."""
    if blocks <= 1:
        return []
    n = (blocks - 1).bit_length()
    distances = [1 << i for i in range(n - 1, -1, -1)]
    return [(distances[0], blocks - distances[0])] + [(d, d) for d in distances[1:]]


def block_pass(rank: int, blocks: int, distance: int, count: int) -> tuple[int, int, list[tuple[int, int]]]:
    """``rank``'s side of a Spar-Reduce-Scatter round among teams of ``blocks`` consecutive ranks:
    (dest, source, [(block it sends, block it adds into)] * count). The dest and source are the
    ranks ``distance`` positions ahead and behind in its own team; the rank at position q sends
    its blocks q + distance + j and adds what arrives into its blocks q + j."""
    team, position = divmod(rank, blocks)
    dest, source = team * blocks + (position + distance) % blocks, team * blocks + (position - distance) % blocks
    return dest, source, [((position + distance + j) % blocks, (position + j) % blocks) for j in range(count)]


def tree_rounds(nprocs: int) -> list[list[tuple[int, int]]]:
    """(source, dest) pairs of each round of a binomial-tree reduction to rank 0, any P: in
    round j every rank r = m 2^(j+1) + 2^j hands its stream to r - 2^j."""
    rounds, distance = [], 1
    while distance < nprocs:
        rounds.append([(r, r - distance) for r in range(distance, nprocs, 2 * distance)])
        distance *= 2
    return rounds


def passed_capacity(capacity: int, sent: int, size: int, whole: bool) -> int:
    """Capacity of a block after a Spar-Reduce-Scatter round adds a block of ``sent`` slots into
    it: its own when the sender re-selected to the block's budget (SparDL), the sum of both when
    the sender handed a whole region over (Ok-Topk; a region stays pairs: its entries lie in a
    sub-range of the ``size`` its indices span)."""
    return min(capacity + sent, size) if whole else capacity


def selected_capacity(k: int, capacity: int, size: int) -> int:
    """Capacity of the top ``k`` entries of a stream of ``capacity`` slots over ``size`` entries."""
    return min(k, capacity, size)


def owned_slot(budgets, blocks: list[tuple[int, int]]) -> int:
    """The slot every rank's selected own block travels in: the largest selection's capacity
    over the blocks' (capacity, size)."""
    return max(selected_capacity(k, capacity, size) for k, (capacity, size) in zip(budgets, blocks))


def allgather_capacities(source_capacity: int, slot: int, size: int, parts: int, delta: float) -> tuple[int, int]:
    """(Pairs of the static slot every part travels in, capacity of the result) of an allgather
    of parts: parts of a reduce-scatter of streams of ``source_capacity``, or, when that is -1,
    parts selected into at most ``slot`` pairs each."""
    if source_capacity < 0:
        return slot, grown_capacity(slot * parts, size, 1, delta)
    return (largest_part_capacity(source_capacity, size, parts, delta),
            gathered_capacity(source_capacity, size, parts, delta))


def selection_budgets(k: int, size: int, parts: int) -> list[int]:
    """Entries kept of each of the P ranges: ceil(k L_q / N), so that they add up to at most
    k + P, and to every entry when k = N."""
    return [-(-k * part_length(size, parts, q) // max(size, 1)) for q in range(parts)]


def oktopk_capacities(k: int, size: int, parts: int) -> tuple[int, int]:
    """(Entries a rank selects locally, entries each region's owner keeps) of Ok-Topk: twice the
    budget, so that a threshold carried from an earlier step may select up to 2k locally and
    2k in all; every entry when k = N (then nothing is ever dropped)."""
    if k >= size:
        return size, size
    return min(2 * k, size), min(-(-2 * k // parts), size)
