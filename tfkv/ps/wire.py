"""Multipart sends and receives of the data plane, through pyzmq's Cython socket methods.

pyzmq's `send_multipart` and `recv_multipart` are Python: a type check per frame, enum flag
arithmetic per frame and a second `getsockopt(RCVMORE)` through its option layer. The data plane's
frames are tfkv's own (bytes, memoryviews, zmq.Frames), so these call the same backend methods
with plain ints; what they send and receive is the same, at a fraction of the cost per message
(benchmarks/results/design_figures.md).
"""

from __future__ import annotations

from typing import Any, Sequence

import zmq
from zmq.backend import Socket as _Backend

_SEND, _RECV = _Backend.send, _Backend.recv
_SNDMORE = int(zmq.SNDMORE)


def send(sock: zmq.Socket, frames: Sequence[Any]) -> None:
    """`sock.send_multipart(frames, copy=False)`: frames from pyzmq's copy threshold up go
    without a copy. Unlike pyzmq's, nothing is checked before the first frame goes: every frame
    must be a buffer (tfkv's own: bytes, memoryviews, arrays, zmq.Frames), or a message is left
    half sent for the next one to complete."""
    last = len(frames) - 1
    for i in range(last):
        _SEND(sock, frames[i], _SNDMORE, False)
    _SEND(sock, frames[last], 0, False)


def recv(sock: zmq.Socket, flags: int = 0) -> list[zmq.Frame]:
    """`sock.recv_multipart(flags, copy=False)`: zmq.Again (NOBLOCK) and a receive timeout raise
    before any frame is taken; the rest of a message is there once its first frame is."""
    frames = [_RECV(sock, flags, False)]
    while frames[-1].more:  # the backend's receive asks RCVMORE itself
        frames.append(_RECV(sock, flags, False))
    return frames
