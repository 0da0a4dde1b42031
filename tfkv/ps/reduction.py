"""How a server spreads a large key's work over its CPUs: element ranges on a small thread pool.

numpy releases the GIL inside a ufunc's loop, so threads that each add (or update) their own
range of a key's values run at once. A server uses as many as the CPUs it may use
(tfkv.ps.cpus: its affinity and cgroup quota), or `kvstore.reduction_nthreads` where set
(MXNET_KVSTORE_REDUCTION_NTHREADS). Each range is at least `MIN_SPAN` values: a hop to a pool
thread and back costs tens of microseconds, what adding some 64K floats costs, so a smaller key
stays on the serving thread, which also takes the first range of a larger one itself.

Every value is computed by the same float32 operations in the same order whichever thread takes
its range: a threaded sum or update is bit-identical to the single-threaded one.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np

from tfkv.ps import cpus, dtypes

_F32 = dtypes.FLOAT32

#: the fewest values a thread takes (256 KiB of float32)
MIN_SPAN = 1 << 16


class Reducer:
    """A server's pool of threads for large keys (started by the first large one)."""

    def __init__(self, nthreads: int = 0, min_span: int = MIN_SPAN):
        self.nthreads = nthreads if nthreads > 0 else cpus.usable()
        self.min_span = max(1, min_span)
        self._pool: ThreadPoolExecutor | None = None

    def spans(self, size: int) -> list[slice]:
        """`size` values cut into the ranges the threads take: one range below 2 * min_span."""
        n = max(1, min(self.nthreads, size // self.min_span))
        bounds = [i * size // n for i in range(n + 1)]
        return [slice(lo, hi) for lo, hi in zip(bounds, bounds[1:])]

    def run(self, fn: Callable[[slice], None], size: int) -> None:
        """`fn(span)` for each range of `size` values: the first on this thread, the others on the
        pool; returns when all are done (raising what one raised)."""
        spans = self.spans(size)
        if len(spans) == 1:
            fn(spans[0])
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.nthreads - 1, thread_name_prefix="tfkv-reduce")
        futures = [self._pool.submit(fn, s) for s in spans[1:]]
        try:
            fn(spans[0])
        finally:
            for f in futures:
                f.result()

    def add(self, a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """a + b (1-D, or any contiguous shape) into `out` (default: a fresh array), in ranges."""
        if out is None:
            out = np.empty_like(a)
        if a.size < 2 * self.min_span or not all(x.flags.c_contiguous for x in (a, b, out)):
            return np.add(a, b, out=out)
        fa, fb, fo = a.reshape(-1), b.reshape(-1), out.reshape(-1)
        self.run(lambda s: np.add(fa[s], fb[s], out=fo[s]), a.size)
        return out

    def accumulate(self, merged: np.ndarray | None, data: np.ndarray) -> np.ndarray:
        """A round's sum with `data` added. The first push is the sum: the received buffer (a zmq
        frame, the channel's opened frame, or decoded from 2 bits) belongs to this round alone
        until it closes, and later pushes add into it, so no fresh array per round (for a large
        key an allocation and its page faults every step). A half-precision push is summed in
        float32 (a fresh array), rounded once at the end. No stored value is ever written into
        (a reply may still be sending it): a read-only first buffer (bytes) makes the sum a fresh
        array, which the later pushes add into."""
        if merged is None:
            return data if data.dtype == _F32 else data.astype(_F32)
        if merged.flags.writeable:
            return self.add(merged, data, out=merged)
        return self.add(merged, data)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None
