#!/usr/bin/env python3
"""Runs a command with a shorter scheduler time slice: ``short_slice.py MICROSECONDS CMD [ARGS...]``.

For benchmarks with more ranks than cores (P = 4 on a 2-core machine), under Linux 6.12+ (EEVDF):
there MPICH's waiting ranks spin in ``sched_yield`` while the rank that holds the work, or one of
its XLA threads, waits for a core, for whole slices of the default 1.4 ms (traced with ``perf
sched``). Whole cells of the allreduce sweep then ran at a floor of 1-4 such slices per call; with
a slice of 100 us (the kernel's minimum) they did not (BENCHMARKS.md). The slice is set on this
process (SCHED_OTHER, nice 0: a custom slice is ``sched_runtime``) and survives the exec; every
thread the command starts inherits it. A system without custom slices keeps its own, with a warning.

    mpirun -n 4 python tools/short_slice.py 100 python -m sparcml_jax.bench allreduce
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys

_SYS_SCHED_SETATTR = {"x86_64": 314, "aarch64": 274}


class _SchedAttr(ctypes.Structure):  # struct sched_attr (include/uapi/linux/sched/types.h)
    _fields_ = [("size", ctypes.c_uint32), ("sched_policy", ctypes.c_uint32), ("sched_flags", ctypes.c_uint64),
                ("sched_nice", ctypes.c_int32), ("sched_priority", ctypes.c_uint32),
                ("sched_runtime", ctypes.c_uint64), ("sched_deadline", ctypes.c_uint64),
                ("sched_period", ctypes.c_uint64), ("sched_util_min", ctypes.c_uint32),
                ("sched_util_max", ctypes.c_uint32)]


def main(argv: list[str]) -> None:
    if len(argv) < 2 or not argv[0].isdigit():
        sys.exit("usage: short_slice.py MICROSECONDS CMD [ARGS...]  (MICROSECONDS: 100-100000)")
    microseconds = int(argv[0])
    if not 100 <= microseconds <= 100_000:
        sys.exit(f"short_slice.py: the slice must be 100-100000 microseconds (the kernel's limits), got {microseconds}")
    number = _SYS_SCHED_SETATTR.get(platform.machine())
    if number is None:
        print(f"short_slice.py: no sched_setattr on {platform.machine()}; slice unchanged", file=sys.stderr)
    else:
        libc = ctypes.CDLL(None, use_errno=True)
        attr = _SchedAttr(size=ctypes.sizeof(_SchedAttr), sched_runtime=microseconds * 1000)
        if libc.syscall(number, 0, ctypes.byref(attr), 0) != 0:
            print(f"short_slice.py: sched_setattr failed ({os.strerror(ctypes.get_errno())}); slice unchanged "
                  "(needs Linux 6.12+)", file=sys.stderr)
    os.execvp(argv[1], argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
