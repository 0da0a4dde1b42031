"""What a server's rounds hold and give back: a round of a key (`Round`) or of a fused key set
(`GroupRound`), a held request (`Held`), a fused PUSHPULL's pulls (`Fused`), and what serving a
request returns (`Outcome`). tfkv.ps.rounds describes how they are used."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Sequence, Union

import numpy as np

from tfkv.errors import TfkvError
from tfkv.ps import protocol as P


class RequestError(TfkvError, ValueError):
    """The request cannot be served; its text goes back to the sender."""


class Fused:
    """A PUSHPULL's pulls: answered in one reply, the keys' values end to end, once every key's
    round has closed. Counted as len(keys) held requests until answered (the worker awaits one
    pull per key)."""

    __slots__ = ("identity", "request", "keys", "values", "answered")

    def __init__(self, identity: bytes, request: P.Message, keys: list[int]):
        self.identity, self.request, self.keys = identity, request, keys
        self.values: dict[int, np.ndarray] = {}
        self.answered = False  # replied to, or refused: no longer held


class Held(NamedTuple):
    """A request held for the next round of a key (a PUSH, a one-key PUSHPULL, a fused PUSHPULL's
    push of one key with the pull that waits for it, or a PULL behind its sender's held push), or
    released to be served again."""

    identity: bytes
    request: P.Message
    pull: Fused | None = None


Reply = tuple[bytes, P.Message]  # a reply to send, and the connection it goes to
# What serving a request gives back, in order: replies to send, and held requests released (each
# served, with what it gives back, before what follows it).
Outcome = Sequence[Union[Reply, Held]]
NOTHING: Outcome = ()


@dataclass
class Round:
    """One synchronous round of a key: who has pushed and what is waiting."""

    merged: np.ndarray | None = None
    pushed: set[int] = field(default_factory=set)
    pulls: list[tuple[bytes, P.Message | Fused]] = field(default_factory=list)
    held: list[Held] = field(default_factory=list)  # for the next round
    rows: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)  # a row-sparse key's: (local rows, values)


@dataclass
class GroupRound:
    """One synchronous round of a fused key set that the workers push as the same PUSHPULL (the
    same keys in the same order, as every worker of a data-parallel job stages them): summed as
    one buffer, closed at once, each worker answered with one buffer; a small key costs a message,
    a round, a slice and an add otherwise. It stands for the keys' own rounds opened and closed
    together, so any request that would see them apart first turns it into them (`_dissolve`),
    and those rounds (`Round`) remain the one definition of what a round does."""

    keys: tuple[int, ...]
    sizes: list[int]
    merged: np.ndarray | None = None
    pushed: set[int] = field(default_factory=set)
    pulls: list[tuple[bytes, P.Message]] = field(default_factory=list)  # the PUSHPULLs to answer
    held: list[Held] = field(default_factory=list)  # a sender's next one, for the next round
