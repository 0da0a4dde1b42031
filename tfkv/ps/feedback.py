"""The sending side of gradient compression: what each key part held back (its residual) and,
with a kind that applies momentum on the sender, its velocity, kept between pushes.

One `Sender` per worker store; `pack` turns one key part's values into the 2-bit words to push
(tfkv.ps.compression), changing that part's residual and velocity once. The arrays are this
worker's own, not the servers' optimizer state: a checkpoint keeps them apart, under the
worker's rank (tfkv.store.dist_feedback).
"""

from __future__ import annotations

import numpy as np

from tfkv.ps import compression


class Sender:
    """Per key part: the residual (and velocity) of `setting`'s 2-bit compression."""

    def __init__(self, setting: compression.Setting, momentum: float = 0.0):
        self.setting = setting
        self.momentum = momentum  # applied before quantising, with a worker_momentum kind
        self._residuals: dict[int, np.ndarray] = {}  # server-side key -> what was held back
        self._velocities: dict[int, np.ndarray] = {}  # server-side key -> the kind's velocity

    @property
    def held(self) -> str:
        """What this sender keeps per key part, in words."""
        return "residuals and velocities" if self.setting.kind.worker_momentum else "residuals"

    def pack(self, skey: int, part: np.ndarray) -> np.ndarray:
        """The uint32 words of `part` (a float32 key part) to push under server-side key `skey`."""
        residual = self._state(self._residuals, skey, part.size)
        if self.setting.kind.worker_momentum:
            velocity = self._state(self._velocities, skey, part.size)
            return compression.pack_corrected(part, velocity, residual, self.setting.threshold, self.momentum)
        return compression.pack(part, residual, self.setting.threshold)

    def held_arrays(self) -> dict[str, dict[int, np.ndarray]]:
        """What this sender holds, by name ("residual", "velocity") and server-side key."""
        return {"residual": self._residuals, "velocity": self._velocities}

    def restore(self, what: str, skey: int, array: np.ndarray) -> None:
        """Put back `what` ("residual" or "velocity") of key part `skey`, as saved."""
        self.held_arrays()[what][skey] = np.array(array, np.float32).reshape(-1)

    @staticmethod
    def _state(arrays: dict[int, np.ndarray], skey: int, size: int) -> np.ndarray:
        array = arrays.get(skey)
        if array is None:  # (not setdefault: that would allocate a zero array every push)
            array = arrays[skey] = np.zeros(size, np.float32)
        return array
