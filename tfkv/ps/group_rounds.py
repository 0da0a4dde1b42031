"""Group rounds of a synchronous server (`GroupRounds`, part of tfkv.ps.rounds.Rounds): a fused
PUSHPULL that every worker sends alike is summed as one buffer (`GroupRound`) and closed at once;
any request that sees its keys apart first turns it into the keys' own rounds (`_dissolve`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from tfkv.ps import protocol as P
from tfkv.ps.round_types import NOTHING, Fused, GroupRound, Held, Outcome


class GroupRounds:
    """Uses the Rounds' `grouped`, `open`, `workers`, `reducer`, `updater`, `values` and `closed`."""

    grouped: dict[int, GroupRound]
    open: Any
    workers: set[int]
    reducer: Any
    updater: Any
    values: dict[int, np.ndarray]
    closed: Any

    def _as_group(self, identity: bytes, msg: P.Message, keys: list[int], sizes: list[int]) -> Outcome | None:
        """Serve a fused PUSHPULL of a synchronous job as a GroupRound when its keys are in no
        other round (or all in this set's own); None: to be served key by key. A group round of
        some of its keys is taken apart first, and the request served again after what that
        releases."""
        group = self.grouped.get(keys[0])
        if group is None or group.keys != tuple(keys):
            for k in keys:
                other = self.grouped.get(k)
                if other is not None:
                    return self._dissolve(other, Held(identity, msg))
            if any(self.open[k].pushed for k in keys):
                return None  # a key of it is in a round of its own: the keys' rounds serve it
            group = GroupRound(tuple(keys), sizes)
            for k in keys:
                self.grouped[k] = group
        if msg.sender in group.pushed:  # pushed again before the round closed: held whole for the next
            group.held.append(Held(identity, msg))
            return NOTHING
        group.merged = self.reducer.accumulate(group.merged, msg.data)
        group.pushed.add(msg.sender)
        group.pulls.append((identity, msg))
        return self._close_group(group) if len(group.pushed) == len(self.workers) else NOTHING

    def ungroup(self, group: GroupRound) -> None:
        for k in group.keys:
            del self.grouped[k]

    def _close_group(self, group: GroupRound) -> Outcome:
        """Each key's value from the round's sum, as its own round's close would; every pull
        answered with the keys' values end to end (without an optimizer, the sum's own buffer)."""
        self.ungroup(group)
        merged, offset, values = group.merged, 0, []
        assert merged is not None
        for k, n in zip(group.keys, group.sizes):
            part = merged[offset:offset + n]
            offset += n
            self.closed[k] += 1
            self.values[k] = part if self.updater is None else self.updater.update(k, self.values[k], part)
            values.append(self.values[k])
        data = merged if self.updater is None else np.concatenate(values)
        out: list = [(identity, P.Message(P.Type.PUSHPULL, seq=request.seq, data=data, reply=True))
                     for identity, request in group.pulls]
        out.extend(group.held)  # each opens the next round
        return out

    def _dissolve(self, group: GroupRound, then: Held) -> Outcome:
        """Turn an open GroupRound into its keys' own rounds (what they would be had each key been
        served on its own: the same pushes summed, the same pulls waiting); its held requests are
        released, then `then`, the request that saw the keys apart."""
        self.ungroup(group)
        pulls = [(identity, Fused(identity, request, list(group.keys))) for identity, request in group.pulls]
        offset = 0
        for k, n in zip(group.keys, group.sizes):
            r = self.open[k]  # empty: a grouped key is in no round of its own
            r.merged = None if group.merged is None else group.merged[offset:offset + n]
            r.pushed, r.pulls = set(group.pushed), list(pulls)
            offset += n
        return [*group.held, then]
