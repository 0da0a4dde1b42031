"""What a server does when a worker of its job finishes (the scheduler's LEFT).

A worker that left pushes no more: an open synchronous round it has not pushed into can never
close, so every request waiting on it (pulls parked until it closes, pushes and the pulls behind
them held for the next round, a fused PUSHPULL once, though it waits in several rounds) is answered at once with an ERROR
naming the key, the round and that worker. A later push into such a round is refused the same way
(tfkv.ps.rounds).
"""

from __future__ import annotations

from typing import NamedTuple

from tfkv.ps import protocol as P
from tfkv.ps.round_types import Fused, GroupRound, Reply, Round
from tfkv.ps.rounds import Rounds


class Departure(NamedTuple):
    """What a worker's leaving did: the rounds that can never close, and the refusals to send."""

    failed: list[str]
    replies: list[Reply]


def leave(rounds: Rounds, wid: int, name: str) -> Departure:
    """Worker `wid` (named `name`) finished: fail every open synchronous round it has not pushed
    into (it never will)."""
    departure = Departure([], [])
    if wid not in rounds.workers:
        return departure
    rounds.left[wid] = name
    if not rounds.sync:
        return departure  # no rounds: every push was applied on arrival
    answered: set[int] = set()  # a fused request waits in several rounds: answered once
    for group in {id(g): g for g in rounds.grouped.values()}.values():
        if wid not in group.pushed:
            departure.failed.append(_fail_group(rounds, group, name, departure.replies))
    for key, r in list(rounds.open.items()):
        if r.pushed and wid not in r.pushed:
            departure.failed.append(_fail_round(rounds, key, r, name, answered, departure.replies))
    return departure


def _fail_round(rounds: Rounds, key: int, r: Round, worker: str, answered: set[int], out: list[Reply]) -> str:
    reason = rounds.never_closes((key,), worker)
    del rounds.open[key]
    waiting = [*r.pulls, *((h.identity, h.request if h.pull is None else h.pull) for h in r.held)]
    for identity, request in waiting:
        if id(request) in answered:
            continue
        answered.add(id(request))
        if type(request) is Fused:
            request.answered = True
            out.append((request.identity, P.error(request.request, reason, left=worker)))
        else:
            out.append((identity, P.error(request, reason, left=worker)))
    return reason


def _fail_group(rounds: Rounds, group: GroupRound, worker: str, out: list[Reply]) -> str:
    reason = rounds.never_closes(group.keys, worker)
    rounds.ungroup(group)
    for identity, request in [*group.pulls, *((h.identity, h.request) for h in group.held)]:
        out.append((identity, P.error(request, reason, left=worker)))
    return reason
