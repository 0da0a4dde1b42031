"""How a server adds up a round's pushes: into the round's own buffer, large arrays over threads.

Arrays of at least the big-array bound (MXNET_KVSTORE_BIGARRAY_BOUND) are summed by
MXNET_KVSTORE_REDUCTION_NTHREADS threads, one slice each (numpy releases the GIL in np.add);
smaller ones stay on the serving thread.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from tfkv.ps import dtypes

_F32 = dtypes.FLOAT32


class Reducer:
    def __init__(self, bigarray_bound: int, nthreads: int):
        self.bound, self.nthreads = bigarray_bound, nthreads
        self._pool: ThreadPoolExecutor | None = None  # started by the first large sum

    def add(self, a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """a + b into `out` (default: a fresh array); large arrays in slices over the threads."""
        n = self.nthreads
        if n <= 1 or a.size < max(self.bound, n):
            return np.add(a, b, out=out)
        if out is None:
            out = np.empty_like(a)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(n, thread_name_prefix="tfkv-reduce")
        bounds = [i * a.size // n for i in range(n + 1)]
        slices = [slice(lo, hi) for lo, hi in zip(bounds, bounds[1:])]
        list(self._pool.map(lambda s: np.add(a[s], b[s], out=out[s]), slices))
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
