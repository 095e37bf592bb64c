"""Pages that a jitted program maps afresh on every call, and what one costs.

XLA:CPU gives every call of a program one temp block of ``compiled.memory_analysis()
.temp_size_in_bytes`` and a fresh buffer per output. It runs the program on the calling thread
when async dispatch is off or when XLA's cost analysis counts fewer than 1000 flops (the PjRt
CPU client's "cheap computation": our native collectives, whose work is in FFI calls), and on a
worker thread otherwise (the mpi4jax transport's programs). glibc serves threads other than the main one from
heaps of at most 64 MiB (``HEAP_MAX_SIZE`` on 64-bit Linux): it maps a larger block for the one
allocation, whatever ``MALLOC_MMAP_MAX_`` says, and unmaps it when it is freed, so the next call
faults every page in again. The main thread's blocks come from the main heap, which the
Makefile's ``KEEP_HEAP`` keeps (without it glibc unmaps large blocks there too, and the rule
counts too few). (Measured with ``strace -f``: an mpi4jax program at N = 2^22,
P = 4 mapped and unmapped 80 MiB on a worker thread per call, 21 000 page faults; the native
program with the same temp size mapped nothing. In a full sweep at P = 4 the rule gave every
row's page faults per call: 18 433 and 20 481 at 2^22, 49 153 for DSAR at 2^24, where two
outputs of 64 MiB join the temp block.)
"""

from __future__ import annotations

import math
import mmap

import jax
import numpy as np
from mpi4py import MPI

from sparcml_jax.collectives.cost_model import _slowest_rank_median

THREAD_HEAP_BYTES = 64 << 20
CHEAP_FLOPS = 1000.0


def fresh_pages(compiled, outputs) -> int:
    """Pages that one call of ``compiled`` (a ``jax.stages.Compiled``) maps afresh, by the rule
    above: its temp block and each output that is too large for a thread's heap, when a worker
    thread allocates them; else none. ``outputs`` is what a call returned. (``compiled.out_info``
    fails on programs with MPI effects.)"""
    if not jax.config.read("jax_cpu_enable_async_dispatch"):
        return 0
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # one entry per partition in older JAX
        cost = cost[0] if cost else {}
    if (cost or {}).get("flops", 0.0) < CHEAP_FLOPS:
        return 0
    blocks = [compiled.memory_analysis().temp_size_in_bytes]
    blocks += [out.nbytes for out in jax.tree.leaves(outputs) if hasattr(out, "nbytes")]
    return sum(math.ceil(size / mmap.PAGESIZE) for size in blocks if size >= THREAD_HEAP_BYTES)


def page_cost(comm: MPI.Comm, nbytes: int = THREAD_HEAP_BYTES, reps: int = 7) -> float:
    """Seconds per page of a block that is mapped, written once per page and unmapped, on every
    rank at once (the ranks fault their temp blocks in during the same collective), the slowest
    rank's median."""

    def touch_fresh_block():
        block = mmap.mmap(-1, nbytes)
        pages = np.frombuffer(block, np.uint8)
        pages[::mmap.PAGESIZE] = 1
        del pages  # the view must go before the mapping can close
        block.close()

    return _slowest_rank_median(comm, touch_fresh_block, reps) / (nbytes // mmap.PAGESIZE)
