"""A worker's requests in flight, tracked until answered, and what to do when one is not.

`Tracker` knows nothing of sockets: the link tells it what it sent (`track`), what came back
(`answered`, `heard`) and what a PING said (`check_held`); `watch` says which silent servers to
ask, and fails the job when a server has answered nothing for TFKV_REQUEST_TIMEOUT.

A dist_sync pull may wait as long as the slowest worker takes to push, so waiting has no
deadline of its own. Instead, a server this worker has awaited in silence for a heartbeat
timeout is asked (PING) how many of this worker's requests it holds: one connection is served
in order, so every request sent before the PING has by its answer been either answered or held
(a pull parked until its round closes). More awaited than held: a reply was lost, fail now
naming it. No answer to the PING, nor any other reply, within TFKV_REQUEST_TIMEOUT: the server
is alive (it heartbeats) but does not serve, fail naming it too.
"""

from __future__ import annotations

import re
import time
from typing import Callable, Iterator, NamedTuple

from tfkv.ps import protocol as P
from tfkv.ps.cluster_env import ClusterEnv
from tfkv.ps.parts import CHUNK_SHIFT
from tfkv.ps.transport.worker import DistError, server_name

_KEY_ID = re.compile(r"\bkey (\d+)\b")  # how a server's messages name a key (tfkv.ps.rounds, tfkv.ps.server)


class Pending(NamedTuple):
    """A request awaiting its answer."""

    server: int
    kind: P.Type  # what it asked (a fused member: its PULL)
    skey: int  # the server-side key it names (0 for a request of no key)
    sent_at: float  # time.monotonic() when it was first sent


class Probe(NamedTuple):
    """A PING in flight to a silent server."""

    seq: int
    sent_at: float


_record = tuple.__new__  # a NamedTuple made without its generated __new__: a request's cost stays a tuple's


def seqs(start: int = 1) -> Iterator[int]:
    """Request numbers as a header carries them: `start`, ... 2**32 - 1, then 1 again (never 0).
    Wrapping here too, a job past 2**32 requests still matches every reply to its request
    (requests in flight are never 2**31 apart)."""
    while True:
        yield from range(start, P.SEQ_MASK + 1)
        start = 1


def before(seq: int, probe: int) -> bool:
    """Whether request `seq` was sent before request `probe`, across the wrap of 32 bits."""
    return 0 < (probe - seq) & P.SEQ_MASK < 1 << 31


class Tracker:
    """The requests awaited from each server, and when each server was last heard."""

    def __init__(self, env: ClusterEnv, servers: list[dict], key_name: Callable[[int], str], lost_fails: bool = True):
        self.env, self.servers = env, servers
        self.lost_fails = lost_fails  # a PING's count naming a lost reply fails the job (not under PS_RESEND)
        self.key_name = key_name  # what messages call a key id: `key 'emb'`, or the caller's name for it
        self.pending: dict[int, Pending] = {}  # seq -> the request
        self._awaited = [0] * len(servers)  # per server: its requests in `pending`
        self._heard = [0.0] * len(servers)  # per server: when it last answered (or we began to wait)
        self._probes: dict[int, Probe] = {}  # server -> its PING in flight

    def track(self, server: int, seq: int, kind: P.Type, skey: int) -> None:
        """Await the answer to request `seq`."""
        now = time.monotonic()
        self.pending[seq] = _record(Pending, (server, kind, skey, now))
        if not self._awaited[server]:
            self._heard[server] = now  # silence counts from when we begin to wait
        self._awaited[server] += 1

    def answered(self, seq: int) -> bool:
        """Retire request `seq`; False if it was not (or no longer) awaited."""
        entry = self.pending.pop(seq, None)
        if entry is None:
            return False
        self._awaited[entry.server] -= 1
        return True

    def heard(self, server: int) -> None:
        self._heard[server] = time.monotonic()

    def probe(self, server: int, seq: int, sent_at: float) -> None:
        """The PING `seq` asks silent `server` what it holds."""
        self._probes[server] = Probe(seq, sent_at)

    def probed(self, server: int, seq: int, held: int) -> None:
        """The answer to a PING: if it is `server`'s probe, check what it holds against what is awaited."""
        probe = self._probes.get(server)
        if probe is not None and probe.seq == seq:
            del self._probes[server]
            self.check_held(server, seq, held)

    def check_held(self, server: int, probe: int, held: int) -> None:
        if not self.lost_fails:
            return  # under PS_RESEND a lost request or reply is sent again instead
        earlier = sorted((seq for seq, e in self.pending.items() if e.server == server and before(seq, probe)),
                         key=lambda seq: self.pending[seq].sent_at)  # oldest first
        if len(earlier) > held:
            raise DistError(f"{self.server_name(server)} did not answer {self.describe(earlier[0])} and "
                            f"holds {held} of the {len(earlier)} requests this worker awaits from it: the reply "
                            "was lost")

    def watch(self) -> list[int]:
        """The servers to ask what they hold (awaited in silence for a heartbeat timeout);
        raises if a server asked has answered nothing for TFKV_REQUEST_TIMEOUT."""
        now, silent = time.monotonic(), []
        for server, awaited in enumerate(self._awaited):
            probe = self._probes.get(server)
            if probe is not None:
                # From the last reply heard, not from the PING: a busy server still answering
                # the requests queued ahead of the PING is serving.
                if now - max(probe.sent_at, self._heard[server]) > self.env.request_timeout:
                    oldest = min((seq for seq, e in self.pending.items() if e.server == server),
                                 key=lambda seq: self.pending[seq].sent_at)
                    raise DistError(f"{self.server_name(server)} has answered nothing for "
                                    f"{now - self._heard[server]:.0f} s, not even a PING sent "
                                    f"{now - probe.sent_at:.0f} s ago, while this worker awaits "
                                    f"{self.describe(oldest)}; it is alive but not serving (raise "
                                    "TFKV_REQUEST_TIMEOUT if it is only slow)")
            elif awaited and now - self._heard[server] > self.env.heartbeat_timeout:
                silent.append(server)
        return silent

    def describe(self, seq: int) -> str:
        entry = self.pending[seq]
        kid, chunk = entry.skey % (1 << CHUNK_SHIFT), entry.skey >> CHUNK_SHIFT
        part = f" (part {chunk})" if chunk else ""
        return (f"{P.Type(entry.kind).name} of {self.key_name(kid)}{part} (request {seq}, sent "
                f"{time.monotonic() - entry.sent_at:.1f} s ago)")

    def named(self, text: str) -> str:
        """A server's text with each key id it names (`key 1099511627776`, a part's id) as the
        caller named the key (`key 'emb'`, or a trainer's layer): a server knows only ids."""
        return _KEY_ID.sub(lambda m: self.key_name(int(m.group(1)) % (1 << CHUNK_SHIFT)), text)

    def server_name(self, server: int) -> str:
        return server_name(self.servers, server)
