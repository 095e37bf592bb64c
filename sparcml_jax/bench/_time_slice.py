"""A shorter scheduler time slice for every thread of a benchmark rank (Linux 6.12+, EEVDF).

With more ranks than cores (P = 4 on this project's 2-core machine), MPICH's waiting ranks spin
with ``sched_yield`` while the rank that holds the work, or one of its XLA threads, waits for a
core. Under EEVDF that wait lasts whole slices of the default 1.4 ms (traced with ``perf
sched``). Whole cells of the allreduce sweep, every case and every repetition, then ran at a
floor of 1-4 such slices per call: seven of seven full sweeps at P = 4 had such a cell. With a
slice of 100 us (the kernel's minimum) on every thread, set before JAX starts its own, which
inherit it, three of three had none (BENCHMARKS.md).
"""

from __future__ import annotations

import ctypes
import os
import platform
import warnings

ENV = "SPARCML_JAX_SCHED_SLICE_US"
_SYS_SCHED_SETATTR = {"x86_64": 314, "aarch64": 274}


class _SchedAttr(ctypes.Structure):  # struct sched_attr (include/uapi/linux/sched/types.h)
    _fields_ = [("size", ctypes.c_uint32), ("sched_policy", ctypes.c_uint32), ("sched_flags", ctypes.c_uint64),
                ("sched_nice", ctypes.c_int32), ("sched_priority", ctypes.c_uint32),
                ("sched_runtime", ctypes.c_uint64), ("sched_deadline", ctypes.c_uint64),
                ("sched_period", ctypes.c_uint64), ("sched_util_min", ctypes.c_uint32),
                ("sched_util_max", ctypes.c_uint32)]


def set_time_slice(microseconds: int) -> bool:
    """Sets the time slice of every thread of this process (SCHED_OTHER, nice 0; a custom slice
    is ``sched_runtime``). Threads started later inherit it. Returns False, with a warning,
    where the system does not allow it."""
    number = _SYS_SCHED_SETATTR.get(platform.machine())
    if number is None or not os.path.isdir("/proc/self/task"):
        warnings.warn(f"{ENV}: no sched_setattr on {platform.system()} {platform.machine()}; slice unchanged")
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    attr = _SchedAttr(size=ctypes.sizeof(_SchedAttr), sched_runtime=microseconds * 1000)
    for tid in os.listdir("/proc/self/task"):
        if libc.syscall(number, int(tid), ctypes.byref(attr), 0) != 0:
            error = os.strerror(ctypes.get_errno())
            warnings.warn(f"{ENV}={microseconds}: sched_setattr failed ({error}); slice unchanged (needs Linux 6.12+)")
            return False
    return True


def current_time_slice_us() -> float | None:
    """This thread's time slice in microseconds (``se.slice`` in ``/proc/thread-self/sched``)."""
    try:
        with open("/proc/thread-self/sched") as f:
            for line in f:
                if line.startswith("se.slice"):
                    return int(line.split(":")[1]) / 1000
    except (OSError, ValueError, IndexError):
        pass
    return None


def apply_from_environment() -> None:
    """Applies ``SPARCML_JAX_SCHED_SLICE_US`` if it is set (the Makefile's bench targets set it)."""
    text = os.environ.get(ENV)
    if not text:
        return
    try:
        microseconds = int(text)
    except ValueError:
        raise SystemExit(f"{ENV} must be a whole number of microseconds (the kernel allows 100-100000), got {text!r}")
    if not 100 <= microseconds <= 100_000:
        raise SystemExit(f"{ENV} must be between 100 and 100000 microseconds (the kernel's limits), got {microseconds}")
    set_time_slice(microseconds)
