"""The receiving side of two-way compression (`both_ways`): this worker's copy of each dense key
part, which the servers' 2-bit replies move (tfkv.ps.replies says what they send).

A pull says which version of the part's copy this worker holds (`holds`: its request's meta); its
reply comes back through `decode` (ServerLink.gather calls it for every reply of a pull asked
here): 2-bit words with the next version are added into the copy (copy + unpack(words), as the
servers move their mirror, so both stay equal bit for bit), words of the same version say nothing
changed, float32 values with a version are the copy whole. Words without a version are a summing
server's reply (update_on_kvstore=false): the value itself, kept nowhere. A copy is never written
into (each is replaced, read-only), so a pull's value may be the copy itself. No TensorFlow here.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tfkv.ps import compression
from tfkv.ps import protocol as P
from tfkv.ps.transport.worker import DistError


class Copies:
    """Per server-side key part: this worker's copy of the servers' weights and its version."""

    def __init__(self) -> None:
        self._held: dict[int, tuple[int, np.ndarray]] = {}  # skey -> (version, copy)
        self._asked: dict[int, int] = {}  # seq of a pull in flight -> the skey it asked for

    def holds(self, skey: int) -> dict[str, int] | None:
        """The meta of a pull of `skey`: the version held, or None when none is."""
        held = self._held.get(skey)
        return None if held is None else {"holds": held[0]}

    def asked(self, seq: int, skey: int) -> None:
        """Pull request `seq` asked for `skey`: its reply goes through `decode`."""
        self._asked[seq] = skey

    def expects(self, seq: int) -> bool:
        """Whether `seq` is a pull asked here whose reply `decode` has yet to take."""
        return seq in self._asked

    def decode(self, seq: int, reply: Any) -> np.ndarray:
        """The values of a pull's reply (ServerLink.gather's): the copy it leaves, or as it came."""
        skey = self._asked.pop(seq, None)
        meta = getattr(reply, "meta", None) or {}
        if skey is None or "threshold" not in meta and "version" not in meta:
            return reply.data  # not a pull asked here, or a server that replies uncompressed
        if reply.dtype != P.DType.TWOBIT:
            copy = np.array(reply.data, np.float32)
            copy.flags.writeable = False
            self._held[skey] = (meta["version"], copy)
            return copy
        if "version" not in meta:  # a summing server's 2-bit sum
            return compression.unpack(reply.data, reply.count, meta["threshold"])
        version, copy = self._held.get(skey, (None, None))
        if version == meta["version"]:
            return copy  # nothing new
        if copy is None or version != meta["version"] - 1:
            raise DistError(f"key part {skey}: a 2-bit reply making version {meta['version']} of a copy this "
                           f"worker holds at version {version}: the servers and this worker disagree")
        if copy.size != reply.count:
            raise DistError(f"key part {skey}: a 2-bit reply of {reply.count} values for a copy of {copy.size}")
        copy = compression.unpack_onto(copy, reply.data, meta["threshold"])
        copy.flags.writeable = False
        self._held[skey] = (meta["version"], copy)
        return copy
