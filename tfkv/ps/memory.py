"""Keep a parameter-server process's freed buffers for its next step instead of giving them back to
the kernel (glibc's malloc).

A job moves the same large buffers every step: ZeroMQ's receive buffers, sealed pieces, a key
assembled from its pieces, the round's sums, TensorFlow's gradient tensors. glibc serves an
allocation above its mmap threshold (which moves with what was freed, up to 32 MiB) from a fresh
mapping and trims its heap once the free memory on top passes twice that, so every step paid
page faults and the kernel's zeroing for memory it had just released. Fixed thresholds (256 MiB,
1 GiB) keep that memory in the heap, which `python -m benchmarks dist_training --models mlp`
shows as samples/s (the figures when this was chosen: benchmarks/results/design_figures.md).

The cost: a process's resident memory stays at its peak (up to 1 GiB more than it holds) rather
than shrinking between steps. A user's own glibc settings (MALLOC_MMAP_THRESHOLD_,
MALLOC_TRIM_THRESHOLD_, GLIBC_TUNABLES) win: nothing is changed then. Other C libraries: nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

import numpy as np

log = logging.getLogger("tfkv.ps")

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 256 << 20
TRIM_THRESHOLD = 1 << 30
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")
_done = False


def keep_freed_buffers(one_arena: bool = False) -> bool:
    """Set glibc's mmap and trim thresholds for this process (once); False where it was left
    alone: not glibc, or the user set glibc's malloc tunables. `one_arena` (a server's): one malloc
    arena for all its threads, as libzmq's I/O thread allocates the received messages the serving
    thread frees (in an arena of its own, a heap emptied that way went back to the kernel: a 16
    MiB key's server faulted 3x the pages). Not a worker's: TensorFlow's threads would queue on
    one arena's lock."""
    global _done
    if _done:
        return True
    if any(name in os.environ for name in _USER_SETTINGS):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 - glibc only: musl has mallopt as a stub
    except (OSError, AttributeError):
        return False
    if not (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
            and (not one_arena or mallopt(M_ARENA_MAX, 1))):
        log.warning("glibc refused tfkv's malloc thresholds; large buffers go back to the kernel after each step")
        return False
    _done = True
    return True


class Buffers:
    """Large receive buffers a server keeps for its next step: a secure job's pushes of more than a
    piece are opened into a buffer of their own (tfkv.ps.channel), a fresh one from malloc each
    time, whose pages glibc's heap, fragmented by the pieces around it, handed out new (the
    kernel zeroing each huge page on first write, some tenth of a server's CPU per MiB pushed).
    A kept buffer is handed out again once nothing else refers to it: no view of it (a round's
    sum, a value, a frame being sent) is left, as its reference count tells."""

    def __init__(self, keep: int = 8, most: int = TRIM_THRESHOLD):
        self.keep, self.most = keep, most  # buffers kept per size; bytes kept in all
        self._kept: dict[int, list[np.ndarray]] = {}
        self._bytes = 0

    def take(self, size: int) -> np.ndarray:
        """A writable buffer of `size` bytes, nothing else referring to it."""
        kept = self._kept.setdefault(size, [])
        for buf in kept:
            if sys.getrefcount(buf) == 3:  # the list's, this loop's and the call's: free
                return buf
        buf = np.empty(size, np.uint8)
        if len(kept) < self.keep and self._bytes + size <= self.most:
            kept.append(buf)
            self._bytes += size
        return buf


# A cgroup's limit and use (v2, then v1): a container's or a batch job's memory, not the machine's.
_CGROUP_FILES = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                 ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"))


def available() -> int:
    """Bytes this process may still allocate without swapping or being killed: the kernel's
    MemAvailable, less where this process's memory cgroup leaves less (1 << 62 where neither says)."""
    free = 1 << 62
    try:
        with open("/proc/meminfo") as f:
            free = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        pass
    for limit_file, usage_file in _CGROUP_FILES:
        try:
            with open(limit_file) as f, open(usage_file) as g:
                limit, usage = f.read().strip(), int(g.read())
        except (OSError, ValueError):
            continue
        if limit.isdigit():  # "max" (v2) is no limit; v1 says a huge number
            free = min(free, max(int(limit) - usage, 0))
        break
    return free
