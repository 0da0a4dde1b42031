"""A server's replies to pulls, 2-bit compressed with error feedback (`both_ways`, beyond MXNet;
BytePS's two-way compression, Dist-EF-SGD, DoubleSqueeze).

With the servers' optimizer (update_on_kvstore) a key keeps a `Mirror`: the copy of its weights
the workers hold. A reply is the change since, pack(weights - mirror) in 2-bit words of the
reply threshold, and the mirror moves by what the words say (mirror + unpack(words)), exactly as
each worker's copy does (tfkv.ps.copies): what was not sent stays in weights - mirror, the
servers' residual, and goes with a later reply. Each mirror has a version (how many replies
moved it); a pull says which version its worker holds (meta "holds"), and gets:
- that version's successor's words, when it holds the one before (meta "version", "threshold");
- nothing new (zero words, the same version) when it holds the newest;
- the mirror whole, in float32 (meta "version"), when it holds nothing or another version (a
  first pull, a resumed worker, a reply lost and asked again past the version it moved).
`dist_sync*`: one mirror per key, moved once per closed round (the first pull after it computes
the words; every worker's pull of that round gets the same), so every worker's copy is the
servers' mirror, bit for bit. `dist_async*`: one mirror per key and worker, moved at each of its
pulls: each worker's copy follows the weights with error feedback, and the copies differ.

Without an optimizer on the servers (update_on_kvstore=false: they only sum) a reply is the
round's sum itself, 2-bit with a residual per key (sum + residual packed; meta "threshold" and
no "version"), computed once per round; before any round the key's value goes whole in float32.

The state a checkpoint carries (`STATE`, with the optimizer's): the servers' weights, whose
mirror is the workers' copy, which the checkpoint holds as the model's weights. No TensorFlow."""

from __future__ import annotations

from typing import Any

import numpy as np

from tfkv.ps import compression
from tfkv.ps import protocol as P

STATE = "server_weights"  # the checkpoint entry of a key's weights on the servers (mirror mode)
_F32 = np.dtype(np.float32)


class Mirror:
    """The copy of a key's weights that its workers hold (`copy`, never written into: replaced),
    its version, the words that made it from the one before, and the round it was made after."""

    __slots__ = ("copy", "version", "words", "round")

    def __init__(self, value: np.ndarray, round_no: int):
        self.copy = _frozen(np.array(value, _F32))
        self.version, self.words, self.round = 0, None, round_no

    def move(self, value: np.ndarray, threshold: float, round_no: int) -> None:
        """Reply to the weights `value`: their change from the copy, packed; the copy moved by it."""
        residual = np.negative(self.copy)  # value - copy, with pack's own addition
        self.words = compression.pack(value, residual, threshold)
        self.copy = _frozen(compression.unpack_onto(self.copy, self.words, threshold))
        self.version += 1
        self.round = round_no


class Replies:
    """What a server's pulls of dense keys return when its replies are compressed (`threshold`
    set by SET_COMPRESSION with both_ways), else their values."""

    def __init__(self) -> None:
        self.threshold: float | None = None  # of the 2-bit replies; None: float32 values
        self._mirrors: dict[Any, Mirror] = {}  # key (sync), or (key, worker) (async) -> its mirror
        self._sums: dict[int, tuple[int, np.ndarray, np.ndarray]] = {}  # key -> (round, residual, words)

    def reply(self, msg: P.Message, value: np.ndarray, round_no: int, sync: bool, summing: bool) -> P.Message:
        """The reply to PULL `msg` of a dense key holding `value`, after `round_no` closed rounds."""
        assert self.threshold is not None
        if summing:
            return self._sum(msg, value, round_no)
        holds = msg.meta.get("holds") if msg.meta else None
        mirror = self._mirrors.get(msg.key if sync else (msg.key, msg.sender))
        if mirror is None:
            mirror = self._mirrors[msg.key if sync else (msg.key, msg.sender)] = Mirror(value, round_no)
        elif sync and mirror.round != round_no:  # the weights changed since the mirror moved
            mirror.move(value, self.threshold, round_no)
        elif not sync and holds == mirror.version:  # async: each pull sends what the weights moved since
            mirror.move(value, self.threshold, round_no)
        if holds is not None and holds == mirror.version - 1 and mirror.words is not None:
            return self._words(msg, mirror.words, mirror.copy.size, mirror.version)
        if holds is not None and holds == mirror.version:
            return self._words(msg, np.zeros(compression.words(mirror.copy.size), np.uint32), mirror.copy.size,
                               mirror.version)
        return P.Message(P.Type.PULL, seq=msg.seq, key=msg.key, data=mirror.copy, reply=True,
                         meta={"version": mirror.version})

    def _words(self, msg: P.Message, words: np.ndarray, count: int, version: int | None) -> P.Message:
        meta: dict[str, Any] = {"threshold": self.threshold}
        if version is not None:
            meta["version"] = version
        return P.Message(P.Type.PULL, seq=msg.seq, key=msg.key, data=words, dtype=P.DType.TWOBIT, count=count,
                         reply=True, meta=meta)

    def _sum(self, msg: P.Message, value: np.ndarray, round_no: int) -> P.Message:
        """A summing server's reply: the round's sum, 2-bit with the key's residual (its value
        whole before any round closed)."""
        if round_no == 0:
            return P.Message(P.Type.PULL, seq=msg.seq, key=msg.key, data=value, reply=True)
        held = self._sums.get(msg.key)
        if held is None or held[0] != round_no:
            residual = held[1] if held is not None else np.zeros(value.size, _F32)
            held = self._sums[msg.key] = (round_no, residual, compression.pack(value, residual, self.threshold))
        return self._words(msg, held[2], value.size, None)

    # -- a checkpoint's state --------------------------------------------------------------------

    def state_names(self) -> list[str]:
        """The entries a key's optimizer state (the servers' optimizer's: never a summing server's)
        gets beside the optimizer's own."""
        return [] if self.threshold is None else [STATE]

    def restore(self, key: int, value: np.ndarray, weights: np.ndarray, round_no: int, sync: bool) -> np.ndarray:
        """A resumed job's servers' weights (`weights`, checkpointed) for a key initialised with the
        workers' copy (`value`, the model's weights the checkpoint holds): the mirror is that copy
        (made now, if no worker pulled yet), the weights what this returns, of the key's dtype."""
        if sync and key not in self._mirrors:
            self._mirrors[key] = Mirror(value, round_no)
        return np.array(weights, value.dtype).reshape(value.shape)


def _frozen(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False  # a reply's payload and a pull's value: never written into
    return array
