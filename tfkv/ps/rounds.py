"""A server's keys and their rounds, as a machine: serving a push or a pull *returns* what follows
from it, the replies to send and the held requests it releases, in order; it never serves a
request itself. The server's one dispatch loop serves each released request before what follows it.

Synchronous mode (`dist_sync*`): pushes of a key are summed until every worker has pushed once;
then the optimizer runs (or the sum becomes the value, when workers update themselves), and pulls
that arrived meanwhile from workers who pushed are answered with the new value. A worker that
pushes the same key twice before the round closes has the second push held for the next round.
Asynchronous mode (`dist_async*`): every push is applied on arrival.

A PUSHPULL of small keys (its metadata lists them) is served as each key's PUSH of its slice,
then its PULL, answered in one reply once every key's round has closed (`Fused`). When every
worker pushes the same key set alike, a synchronous round of the set is summed as one buffer
(`GroupRound`); a request that sees the keys apart first turns it into the keys' own rounds.

A worker that finished (the scheduler's LEFT) pushes no more: a push into a round it has not
pushed into is refused with an ERROR naming the key, the round and that worker (the rounds open
when it left fail: tfkv.ps.departures). Its own pushes held here when it left are its last
rounds, not rounds it owes: each joins its round when that opens.

A key holds the dtype its INIT carried (float32, float16 or bfloat16; tfkv.ps.dtypes) and takes
pushes of that dtype only. A half key's pushes are summed in float32 (as MXNet's servers may: the
sum of the workers' half values is rounded once, at the end, not after every addition), then
stored, sent and updated in its dtype: without `multi_precision` the update reads and writes half
weights and state (MXNet's float16 update); with it the updater keeps a float32 master copy
(tfkv.ps.updater). Pushes may arrive 2-bit compressed (protocol dtype TWOBIT); they are decoded
to float32 with the threshold a worker announced (SET_COMPRESSION) before they are summed.

A row-sparse key (tfkv.ps.rows: this server's shard of a table's rows) takes pushes and pulls
that name rows (the protocol's rows frame) and nothing else; a float16 key's rows are summed in
float32 and updated as a dense half key's. Its synchronous round closes as a
dense key's: when every worker has pushed once (a worker whose batch named none of this shard's
rows pushes no rows, so that the round closes); the rows pushed are then summed per unique row
and the optimizer updates those rows only (NumpyUpdater.update_rows, MXNet's lazy update), or,
without one, the shard becomes the summed rows (every other row zero), as MXNet's store does.
A row pull from a worker that pushed into the open round waits for it, as a dense pull does.

A pull answers after every push its sender made before it. When the sender's next push of the key
is held for the next round (it pushed again before this round closed: a worker whose last row pull
skipped this server, its rows all elsewhere, did not wait for this round), the pull is held behind
that push and waits for the round it opens, so it never returns the round before.

How many of a sender's requests are held unanswered (what a PING answers, for the worker's
lost-reply detection) is counted from what the rounds hold (`held`), never kept beside them.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Callable, Sequence

import numpy as np

from tfkv.ps import compression, dtypes
from tfkv.ps import protocol as P
from tfkv.ps.reduction import Reducer
from tfkv.ps.replies import Replies
from tfkv.ps.group_rounds import GroupRounds
from tfkv.ps.round_types import NOTHING, Fused, GroupRound, Held, Outcome, Reply, RequestError, Round
from tfkv.ps.rows import Shard, merge
from tfkv.ps.updater import NumpyUpdater

_F32 = dtypes.FLOAT32


class Rounds(GroupRounds):
    """The values of a server's keys, their optimizer, and their open rounds."""

    def __init__(self, workers: set[int], reducer: Reducer):
        self.workers = workers
        self.reducer = reducer
        self.sync = True
        self.updater: NumpyUpdater | None = None
        self.threshold: float | None = None  # of 2-bit pushes, once a worker set compression
        self.replies = Replies()  # what a dense pull returns: 2-bit with both_ways (tfkv.ps.replies)
        self.values: dict[int, np.ndarray] = {}
        self.shards: dict[int, Shard] = {}  # row-sparse keys (tfkv.ps.rows)
        self.open: dict[int, Round] = defaultdict(Round)
        self.grouped: dict[int, GroupRound] = {}  # key -> the open GroupRound it is in
        self.left: dict[int, str] = {}  # workers that finished (LEFT), by id: their names
        self.closed: Counter[int] = Counter()  # per key: rounds closed (the round numbers in errors)

    # -- what a request carries ----------------------------------------------------------------

    def value(self, key: int) -> np.ndarray:
        value = self.values.get(key)
        if value is None:
            if key in self.shards:
                raise RequestError(f"key {key} is row-sparse: a request of it names its rows (push rows, "
                                   "row_sparse_pull)")
            raise RequestError(f"key {key} is not initialised on this server")
        return value

    def shard(self, msg: P.Message) -> Shard:
        """The row-sparse key a request names rows of."""
        shard = self.shards.get(msg.key)
        if shard is None:
            if msg.key in self.values:
                raise RequestError(f"key {msg.key} is dense: a {msg.type.name} naming rows is for a row-sparse key")
            raise RequestError(f"key {msg.key} is not initialised on this server")
        if msg.rows is None:
            raise RequestError(f"key {msg.key} is row-sparse: a {msg.type.name} of it names its rows (push rows, "
                               "row_sparse_pull)")
        return shard

    def local(self, shard: Shard, msg: P.Message) -> np.ndarray:
        """The shard's rows a request names; RequestError naming the key if one is not of it."""
        try:
            return shard.local(msg.rows)
        except ValueError as e:
            raise RequestError(f"key {msg.key}: {e}") from None

    def rows(self, shard: Shard, msg: P.Message) -> tuple[np.ndarray, np.ndarray]:
        """(local rows, values (n, width)) a request carries; RequestError naming the key if they do not fit."""
        try:
            return shard.rows_of(msg.rows, msg.data)
        except ValueError as e:
            raise RequestError(f"key {msg.key}: {e}") from None

    def payload(self, msg: P.Message, size: int | None = None) -> np.ndarray:
        """The values a request carries (2-bit pushes decoded to float32), `size` of them."""
        if msg.data is None:
            raise RequestError(f"{msg.type.name} carries no data")
        count = msg.count if msg.dtype == P.DType.TWOBIT else msg.data.size
        if size is not None and count != size:
            raise RequestError(f"key {msg.key}: {count} values pushed, the key holds {size}")
        if msg.dtype == P.DType.TWOBIT:  # decoded to float32, whatever the key's dtype
            if self.threshold is None:
                raise RequestError("a 2-bit compressed push, but no worker set gradient compression")
            try:
                return compression.unpack(msg.data, msg.count, self.threshold)
            except ValueError as e:
                raise RequestError(f"key {msg.key}: {e}") from None
        return msg.data

    def _async_updater(self) -> NumpyUpdater:
        if self.updater is None:
            raise RequestError("dist_async needs an optimizer on the servers: without one each push would "
                               "overwrite the weights; set update_on_kvstore=true")
        return self.updater

    # -- serving -------------------------------------------------------------------------------

    def push(self, identity: bytes, msg: P.Message) -> Outcome:
        """A key's PUSH: applied (async), summed into the key's round, or held for its next one."""
        if msg.rows is not None or msg.key in self.shards:
            return self._push_rows(identity, msg)
        group = self.grouped.get(msg.key)
        if group is not None:
            return self._dissolve(group, Held(identity, msg))
        value = self.value(msg.key)
        data = self.payload(msg, value.size)
        if data.dtype != value.dtype and msg.dtype != P.DType.TWOBIT:
            raise RequestError(f"key {msg.key}: a {data.dtype.name} push to a {value.dtype.name} key (a key's dtype "
                               "is fixed at init)")
        if not self.sync:
            self.values[msg.key] = self._async_updater().update(msg.key, value, data)
            return _acked(identity, msg)
        return self._join(identity, msg, lambda r: setattr(r, "merged", self.reducer.accumulate(r.merged, data)))

    def _push_rows(self, identity: bytes, msg: P.Message) -> Outcome:
        """A row-sparse key's PUSH: its rows applied (async), added to the key's round, or held."""
        shard = self.shard(msg)
        local, rows = self.rows(shard, msg)
        if not self.sync:
            self._async_updater().update_rows(msg.key, shard.value, *merge(local, rows))
            return _acked(identity, msg)
        return self._join(identity, msg, lambda r: r.rows.append((local, rows)))

    def _join(self, identity: bytes, msg: P.Message, add: Callable[[Round], None]) -> Outcome:
        """A synchronous push into its key's round (dense or rows: `add` puts its values in), held
        for the next round if its sender already pushed, refused if the round can never close."""
        r = self.open[msg.key]
        if msg.sender in r.pushed:
            r.held.append(Held(identity, msg))
            return NOTHING  # acknowledged when its round opens
        if self.left:
            refused = self._refuse_owed(identity, msg, (msg.key,))
            if refused:
                return refused
        add(r)
        r.pushed.add(msg.sender)
        if len(r.pushed) < len(self.workers):
            return _acked(identity, msg)
        out = list(_acked(identity, msg))
        self._close(msg.key, r, out)
        return out

    def _waiting(self, key: int, sender: int) -> Round | None:
        """The round a pull of `key` by `sender` waits for: one this sender has pushed into (sync)."""
        r = self.open.get(key)
        return r if self.sync and r is not None and sender in r.pushed else None

    def pull(self, identity: bytes, msg: P.Message) -> Outcome:
        """A key's PULL: answered now, or when the round its sender pushed into closes."""
        if msg.rows is not None or msg.key in self.shards:
            self.local(self.shard(msg), msg)  # refused now if a row is not of the shard
        else:
            group = self.grouped.get(msg.key)
            if group is not None:
                return self._dissolve(group, Held(identity, msg))
            self.value(msg.key)
        r = self._waiting(msg.key, msg.sender)
        if r is not None:
            if any(h.request.sender == msg.sender for h in r.held):
                # Its sender's next push waits for the next round: so does the pull, served again
                # behind that push when the round opens (a pull answers after every push before it,
                # whichever servers this sender's earlier pulls skipped).
                r.held.append(Held(identity, msg))
                return NOTHING
            r.pulls.append((identity, msg))  # answered when the round closes
            return NOTHING
        return [(identity, self._pulled(msg))]

    def _pulled(self, msg: P.Message) -> P.Message:
        if msg.rows is not None:  # the rows asked for, in their order (checked when the pull came)
            shard = self.shards[msg.key]
            data = shard.gather(shard.local(msg.rows))
        else:
            data = self.values[msg.key]
            if self.replies.threshold is not None:
                return self.replies.reply(msg, data, self.closed[msg.key], self.sync, self.updater is None)
        return P.Message(P.Type.PULL, seq=msg.seq, key=msg.key, data=data, reply=True)

    def pushpull(self, identity: bytes, msg: P.Message) -> Outcome:
        """Keys pushed and pulled in one request. Without metadata, the header's key: served as
        its PUSH, then its PULL. Small keys fused: each key's push is served as a PUSH of its slice
        (the same rounds, held pushes and updates), its pull as a PULL whose value goes into one
        reply; checked whole before anything is applied."""
        if msg.meta is None or "keys" not in msg.meta:  # (a one-key PUSHPULL's meta: what its pull holds)
            return self._pushpull_one(identity, msg)
        keys = msg.meta["keys"]
        if not self.sync:
            self._async_updater()
        if msg.dtype != P.DType.FLOAT32:
            raise RequestError("PUSHPULL carries float32 values")
        if len(set(keys)) != len(keys):
            raise RequestError("PUSHPULL names a key twice")
        values = [self.value(k) for k in keys]
        if any(v.dtype != _F32 for v in values):
            raise RequestError("PUSHPULL names a half-precision key; those go as PUSH and PULL")
        sizes = [v.size for v in values]
        if sum(sizes) != msg.data.size:
            raise RequestError(f"PUSHPULL of {len(keys)} keys holding {sum(sizes)} values carries {msg.data.size}")
        if self.left and self.sync:
            refused = self._refuse_owed(identity, msg, keys)
            if refused:
                return refused
        if self.sync:
            grouped = self._as_group(identity, msg, keys, sizes)
            if grouped is not None:
                return grouped
        return self._members(Fused(identity, msg, keys), sizes)

    def _pushpull_one(self, identity: bytes, msg: P.Message) -> Outcome:
        """A PUSHPULL of the header's key: its PUSH, then its PULL, or held whole for the next round."""
        if msg.key in self.shards:
            self.value(msg.key)  # refused: a PUSHPULL names no rows
        group = self.grouped.get(msg.key)
        if group is not None:
            return self._dissolve(group, Held(identity, msg))
        r = self._waiting(msg.key, msg.sender)
        if r is not None:  # its push waits for the next round (as a second PUSH would): its pull too
            r.held.append(Held(identity, msg))
            return NOTHING
        if self.left and self.sync:
            refused = self._refuse_owed(identity, msg, (msg.key,))
            if refused:
                return refused
        pushed = self.push(identity, P.Message(P.Type.PUSH, msg.sender, msg.seq, msg.key, data=msg.data,
                                               dtype=msg.dtype, count=msg.count, want_ack=False))
        # What the push releases (the next round's pushes, by other senders) cannot close that
        # round nor change the key's value, so the pull is answered as it would be after them.
        pulled = self.pull(identity, P.Message(P.Type.PULL, msg.sender, msg.seq, msg.key, meta=msg.meta))
        return [*pushed, *pulled] if pushed else pulled

    def _members(self, fused: Fused, sizes: list[int]) -> Outcome:
        """A fused PUSHPULL's pushes, key by key. Once one releases requests, the keys after it are
        released behind them, so that those are served first, as with the keys pushed one by one."""
        keys, out, starts = fused.keys, [], [0]
        for n in sizes:
            starts.append(starts[-1] + n)
        for i, k in enumerate(keys):
            served = self.member(fused.identity, _slice(fused.request, k, starts[i], starts[i + 1]), fused)
            if served:
                out.extend(served)
                if any(type(item) is Held for item in served):
                    out.extend(Held(fused.identity, _slice(fused.request, keys[j], starts[j], starts[j + 1]), fused)
                               for j in range(i + 1, len(keys)))
                    break
        return out

    def member(self, identity: bytes, push: P.Message, fused: Fused) -> Outcome:
        """A fused PUSHPULL's push of one key, then its pull, filled now or when the round the push
        went into closes. Pushed again before the key's round closed, the push waits for the next
        round and its pull with it (a pull answers after its own push, as a one-key PUSHPULL's)."""
        group = self.grouped.get(push.key)
        if group is not None:
            return self._dissolve(group, Held(identity, push, fused))
        r = self._waiting(push.key, push.sender)
        if r is not None:
            r.held.append(Held(identity, push, fused))
            return NOTHING
        out = list(self.push(identity, push))
        # As for a one-key PUSHPULL, what the push released leaves this pull's answer as it is.
        r = self._waiting(push.key, push.sender)
        if r is not None:
            r.pulls.append((fused.identity, fused))
        else:
            self._fill(fused, push.key, out)
        return out

    def _fill(self, fused: Fused, key: int, out: list) -> None:
        fused.values[key] = self.values[key]  # never written into: replaced by each update
        if len(fused.values) == len(fused.keys):
            fused.answered = True
            data = np.concatenate([fused.values[k] for k in fused.keys])
            out.append((fused.identity, P.Message(P.Type.PUSHPULL, seq=fused.request.seq, data=data, reply=True)))

    def _close(self, key: int, r: Round, out: list) -> None:
        shard = self.shards.get(key)
        if shard is not None:
            self._close_rows(key, shard, r)
        elif self.updater is not None:
            assert r.merged is not None
            self.values[key] = self.updater.update(key, self.values[key], r.merged)
        else:
            assert r.merged is not None
            value = self.values[key]
            self.values[key] = r.merged if value.dtype == _F32 else r.merged.astype(value.dtype)
        self.open[key] = Round()
        self.closed[key] += 1
        for identity, pull in r.pulls:
            if type(pull) is Fused:
                self._fill(pull, key, out)
            else:
                out.append((identity, self._pulled(pull)))
        out.extend(r.held)  # each opens the next round

    def _close_rows(self, key: int, shard: Shard, r: Round) -> None:
        """A row-sparse round's rows summed per row, then applied (lazily) or made the shard."""
        local = np.concatenate([ids for ids, _ in r.rows])
        values = np.concatenate([values for _, values in r.rows])
        rows, summed = merge(local, values if values.dtype == _F32 else values.astype(_F32))
        if self.updater is not None:
            self.updater.update_rows(key, shard.value, rows, summed)
        else:
            shard.value[...] = 0
            shard.value[rows] = summed  # a float16 key's sum rounded once, here

    # -- held requests -------------------------------------------------------------------------

    def held(self, sender: int) -> int:
        """How many of `sender`'s requests the rounds hold unanswered: pulls waiting for a round,
        requests held for the next round that await an answer (a PUSHPULL or a PULL always, a PUSH
        when acknowledged under PS_RESEND), a fused PUSHPULL's len(keys)."""
        count, fused = 0, {}
        for r in self.open.values():
            for _, pull in r.pulls:
                if type(pull) is Fused:
                    fused[id(pull)] = pull
                elif pull.sender == sender:
                    count += 1
            for h in r.held:
                if h.pull is not None:
                    fused[id(h.pull)] = h.pull
                elif h.request.sender == sender:  # a held PUSH awaits an answer only when acknowledged
                    count += 1 if h.request.type != P.Type.PUSH else int(h.request.want_ack)
        for group in {id(g): g for g in self.grouped.values()}.values():
            waiting = [request for _, request in group.pulls] + [h.request for h in group.held]
            count += len(group.keys) * sum(request.sender == sender for request in waiting)
        return count + sum(len(f.keys) for f in fused.values() if not f.answered and f.request.sender == sender)

    # -- a worker that left --------------------------------------------------------------------

    def never_closes(self, keys: Sequence[int], worker: str) -> str:
        """The one line a request waiting on a round of `keys` (pushed together) gets."""
        also = f" (and the {len(keys) - 1} keys pushed with it)" if len(keys) > 1 else ""
        return (f"key {keys[0]}{also}: round {self.closed[keys[0]] + 1} can never close: {worker} left "
                "the job (it finished and closed its store) before pushing to it")

    def _refuse_owed(self, identity: bytes, msg: P.Message, keys: Sequence[int]) -> list[Reply]:
        """An ERROR for `msg` (a push into the rounds of `keys`) if one of those rounds can never
        close, because a worker that left has not pushed into it. A push its sender already made
        in a round waits for the next one and is asked when it opens."""
        for key in keys:
            group = self.grouped.get(key)
            r = group if group is not None else self.open.get(key)
            pushed = r.pushed if r is not None else set()
            if msg.sender in pushed:
                continue
            # The sender's own push is never owed by it: a worker that left may still have pushes
            # held here (its last pulls skipped this server), each opening the round it belongs to.
            gone = next((name for wid, name in self.left.items() if wid not in pushed and wid != msg.sender), None)
            if gone is not None:
                return [(identity, P.error(msg, self.never_closes((key,), gone), left=gone))]
        return []


def _acked(identity: bytes, msg: P.Message) -> Outcome:
    """A push's acknowledgement, asked for under PS_RESEND only: without it one connection delivers
    in order and one thread serves it, so the answer to a later pull proves the push was applied."""
    return [(identity, P.ack(msg))] if msg.want_ack else NOTHING


def _slice(msg: P.Message, key: int, start: int, end: int) -> P.Message:
    """A fused PUSHPULL's push of one key: its values [start, end) of the request's."""
    return P.Message(P.Type.PUSH, msg.sender, msg.seq, key, data=msg.data[start:end], want_ack=False)
