"""How much a node answers a connection that is not a member of its job: a few errors, then nothing.

The scheduler's and the servers' ROUTER sockets have no send high-water mark (a ROUTER drops
silently past it, and a lost reply hangs a member), so every reply stays in the node's memory
until its peer reads it. Members read their replies. A stranger that sends garbage and never
reads would grow that queue, and the node's log, without bound if each message were answered.
So a connection that is not a member gets at most PER_PEER answers (enough to tell a node that
registers wrongly, or a worker whose first request was malformed, what was wrong), at most
MAX_PEERS such connections get any, and the rest is dropped unanswered, logged once: at most
PER_PEER * MAX_PEERS replies of at most one ERROR each (protocol.error caps their text).
"""

from __future__ import annotations

import logging

log = logging.getLogger("tfkv.ps")

PER_PEER = 8
MAX_PEERS = 256


class Strangers:
    """The answers left to each connection that is not (yet) a member."""

    def __init__(self, node: str):
        self.node = node  # the node's name, for its log
        self._answered: dict[bytes, int] = {}
        self._full = False

    def may_answer(self, identity: bytes) -> bool:
        """Whether to answer this stranger once more (counted as answered when True)."""
        count = self._answered.get(identity)
        if count is None:
            if len(self._answered) >= MAX_PEERS:
                if not self._full:
                    self._full = True
                    log.warning("%s: %d connections that are not members of this job were answered; "
                                "what any other stranger sends is dropped unanswered", self.node, MAX_PEERS)
                return False
            count = 0
        if count >= PER_PEER:
            return False
        self._answered[identity] = count + 1
        if count + 1 == PER_PEER:
            log.warning("%s: a connection that is not a member of this job was refused %d times; what it "
                        "sends from now on is dropped unanswered", self.node, PER_PEER)
        return True
