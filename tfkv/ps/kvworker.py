"""A worker's key-value calls to the servers, in layouts and arrays (ps-lite's KVWorker).

The store (tfkv.store.dist) knows its keys (ids, layouts, tables) and sums this machine's
values; here each call becomes the requests it needs: a dense key's parts (`tfkv.ps.parts.plan`)
pushed, pulled or pushpulled, small float32 keys fused into one PUSHPULL per server, a 2-bit
compressed payload when compression is set, a table's rows cut by their servers and into chunks,
the servers' optimizer and its state asked for and sent. Every pull, of a key's parts or of a
table's rows, completes one way (`ServerLink.gather`) into the place it lands in. Requests,
their numbers, their order and waiting are `tfkv.ps.worker.ServerLink`'s; resending is its
transport's (one flag, PS_RESEND, read there). No TensorFlow here.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Iterable, Iterator, Sequence

import numpy as np

from tfkv.ps import compression
from tfkv.ps import protocol as P
from tfkv.ps.copies import Copies
from tfkv.ps.dtypes import FLOAT32
from tfkv.ps.feedback import Sender
from tfkv.ps.parts import Layout, Pull, RowPull, TableLayout, plan, row_chunks
from tfkv.ps.worker import ServerLink

FUSED_KEY_BYTES = 64 << 10  # a key part up to this size may be pushed and pulled in a PUSHPULL



class Packed:
    """A key's push already 2-bit packed, one array of uint32 words per part of its layout (the
    compiled step packs it: tfkv.parallel.packing); it goes out as it is, through no Sender."""

    def __init__(self, layout: Layout, parts: Sequence[np.ndarray]):
        if len(parts) != len(layout.parts) or any(
                w.dtype != np.uint32 or w.shape != (compression.words(p.end - p.start),)
                for w, p in zip(parts, layout.parts)):
            raise ValueError(f"packed push: {[w.shape for w in parts]} words for parts of "
                             f"{[p.end - p.start for p in layout.parts]} values")
        self.parts = list(parts)


Flat = Callable[[], "np.ndarray | Packed"]  # a key's value, summed over this machine's devices when asked for


class KVWorker:
    """This worker's push, pull and pushpull of keys, rows and optimizer state, over `link`."""

    def __init__(self, link: ServerLink):
        self.link = link
        self.sender: Sender | None = None  # 2-bit compression of pushes, when set
        self.timeline: Any = None  # tfkv.timeline.Timeline: the store's, when kvstore.timeline is set
        self.copies: Copies | None = None  # this worker's copies of the weights, when replies are 2-bit too
        self.push_bytes = 0  # payload bytes of every PUSH sent (measures compression), row ids included
        # payload bytes asked for by pulls (the values, and row ids sent), replies' values; with
        # 2-bit replies (both_ways) the bytes of the replies as they came
        self.pull_bytes = 0

    @property
    def count(self) -> int:
        return self.link.count

    # -- control -------------------------------------------------------------------------------

    def _to_every_server(self, kind: P.Type, meta: dict) -> list[int]:
        return [self.link.request(s, P.Message(kind, meta=meta)) for s in range(self.count)]

    def configure(self, sync: bool) -> None:
        """Tell every server whether rounds are synchronous, and wait until each knows."""
        self.link.wait(self._to_every_server(P.Type.CONFIGURE, {"sync": sync}))

    def set_compression(self, threshold: float, pull_threshold: float | None = None) -> None:
        """Tell every server how pushes are compressed (the same words for every 2-bit kind) and,
        with `pull_threshold`, that its replies to pulls are 2-bit too (both_ways)."""
        meta: dict[str, Any] = {"type": "2bit", "threshold": threshold}
        if pull_threshold is not None:
            meta.update(both_ways=True, pull_threshold=pull_threshold)
        self._to_every_server(P.Type.SET_COMPRESSION, meta)

    def keep_copies(self, on: bool) -> None:
        """Keep a copy of each dense key part that 2-bit replies move (tfkv.ps.copies), or none."""
        if on and self.copies is None:
            self.copies = Copies()
            self.link.decoding = self._decoded
        elif not on:
            self.copies = self.link.decoding = None

    def _decoded(self, seq: int, reply: Any) -> np.ndarray:
        """A pull's reply through this worker's copies; its bytes as they came (2-bit or whole)."""
        if self.copies.expects(seq):  # (a table's row pulls counted their bytes when asked)
            self.pull_bytes += reply.data.nbytes
        return self.copies.decode(seq, reply)

    def set_optimizer(self, spec: dict) -> None:
        """Tell every server the optimizer it runs (`tfkv.optim.to_dict`'s)."""
        self._to_every_server(P.Type.SET_OPTIMIZER, {"optimizer": spec})

    # -- dense keys ----------------------------------------------------------------------------

    def plan(self, kid: int, shape: tuple[int, ...], dtype: np.dtype, bigarray_bound: int, chunk_bytes: int) -> Layout:
        """Key id `kid`'s layout on the servers, and whether it is fused: only a float32 key of
        one small part, as a PUSHPULL of many keys carries one dtype (half keys go as a one-key
        PUSHPULL each, still batched into one ZeroMQ message per server). (Under PS_RESEND no
        key travels in a PUSHPULL at all: `ServerLink.exchange`.)"""
        layout = plan(kid, shape, self.count, bigarray_bound, chunk_bytes, dtype)
        nbytes = dtype.itemsize * layout.size
        layout.fusable = (len(layout.parts) == 1 and dtype is FLOAT32 and 0 < nbytes <= FUSED_KEY_BYTES
                          and self.link.env.fusion_bytes > 0)
        return layout

    def init(self, layout: Layout, flat: np.ndarray) -> None:
        for part in layout.parts:
            self.link.request(part.server, P.Message(P.Type.INIT, key=part.skey, data=flat[part.start:part.end]))

    def push(self, layout: Layout, flat: np.ndarray | Packed) -> None:
        for i, part in enumerate(layout.parts):
            self.link.push(part.server, self._carrying(P.Type.PUSH, part.skey, _payload(flat, i, part)))

    def pull(self, key: Hashable, layout: Layout, outs: list[Any]) -> Pull:
        """A key's pull requests, one per part; the value goes into `outs` (Pull)."""
        pull = Pull(key, layout, outs)  # checks the outs before anything is sent
        if self.copies is None:  # (with copies: the replies' bytes, as they come)
            self.pull_bytes += layout.size * layout.dtype.itemsize
        pull.expect([self._asked(part.skey, self.link.request(part.server, P.Message(
            P.Type.PULL, key=part.skey, meta=self.copies and self.copies.holds(part.skey)))) for part in layout.parts])
        return pull

    def _asked(self, skey: int, seq: int) -> int:
        """Pull `seq` of key part `skey` sent: its reply moves this worker's copy (both_ways)."""
        if self.copies is not None:
            self.copies.asked(seq, skey)
        return seq

    def pushpull(self, keys: Iterable[tuple[Hashable, Layout, list[Any], Flat]]) -> list[Pull]:
        """Each key's push and pull request, in order, without waiting: each pull right behind its
        push, so replies flow while later pushes do (one PUSHPULL per part, small keys fused per
        server), or as the link orders them when it resends requests (`ServerLink.exchange`).
        Call under `link.lock`."""
        fusing = self.sender is None  # a 2-bit payload is no float32 slice of a fused one

        def together(item: tuple[Hashable, Layout, list[Any], Flat]) -> Pull:
            key, layout, outs, flat = item
            both = self._pushpull_fused if fusing and layout.fusable else self._pushpull_parts
            return both(key, layout, outs, flat)

        if self.timeline is not None:
            together = self.timeline.issuing(together)
        return self.link.exchange(list(keys), together, push=lambda item: self.push(item[1], item[3]()),
                                  pull=lambda item: self.pull(item[0], item[1], item[2]))

    def _pushpull_parts(self, key: Hashable, layout: Layout, outs: list[Any], flat: Flat) -> Pull:
        """A key's push and pull as one PUSHPULL per part, its payload the message's last frame.
        (A PUSH with its PULL's header behind the payload costs libzmq a write more per message.)"""
        pull = Pull(key, layout, outs)  # checks the outs before anything is sent
        value = flat()
        if self.copies is None:  # (with copies: the replies' bytes, as they come)
            self.pull_bytes += layout.size * layout.dtype.itemsize
        pull.expect([self._asked(part.skey, self.link.request(part.server, self._carrying(
            P.Type.PUSHPULL, part.skey, _payload(value, i, part)))) for i, part in enumerate(layout.parts)])
        return pull

    def _pushpull_fused(self, key: Hashable, layout: Layout, outs: list[Any], flat: Flat) -> Pull:
        """A small key's push and pull, staged with its server's other small keys into one
        PUSHPULL request (ServerLink.pushpull)."""
        pull = Pull(key, layout, outs)  # checks the outs before anything is sent
        value = flat()
        self.push_bytes += value.nbytes
        self.pull_bytes += value.nbytes
        pull.expect([self.link.pushpull(layout.parts[0].server, layout.parts[0].skey, value)])
        return pull

    def _carrying(self, kind: P.Type, skey: int, part: np.ndarray | tuple[np.ndarray, int]) -> P.Message:
        """A PUSH or PUSHPULL of one key part: 2-bit compressed with `set_gradient_compression`
        (its residual changes here, once; a resend under PS_RESEND repeats the frames), or its
        (words, count) packed already in the compiled step."""
        if isinstance(part, tuple):
            msg = P.Message(kind, key=skey, data=part[0])
            msg.dtype, msg.count = P.DType.TWOBIT, part[1]
        elif self.sender is not None:
            msg = P.Message(kind, key=skey, data=self.sender.pack(skey, part))
            msg.dtype, msg.count = P.DType.TWOBIT, part.size
        else:
            msg = P.Message(kind, key=skey, data=part)
        if kind == P.Type.PUSHPULL and self.copies is not None:
            msg.meta = self.copies.holds(skey)
        self.push_bytes += msg.data.nbytes
        return msg

    def gather(self, pulls: Sequence[Pull | RowPull]) -> Iterator[tuple[Hashable, Any]]:
        """(key, value) of each of `pulls` as its last part arrives (ServerLink.gather)."""
        return self.link.gather(pulls)

    # -- row-sparse keys (tables) --------------------------------------------------------------

    def init_table(self, kid: int, table: TableLayout, spec: dict) -> None:
        """Every server makes its shard of table `kid` from its description `spec`."""
        shape, count = table.shape, self.count
        for s in range(count):
            meta = {"table": {"rows": shape[0], "width": table.width, "shard": s, "shards": count,
                              "sharding": table.placement.sharding, "dtype": table.dtype.name, **spec}}
            self.link.request(s, P.Message(P.Type.INIT, key=kid, meta=meta))

    def set_rows(self, kid: int, table: TableLayout, ids: np.ndarray, data: Any, chunk_bytes: int) -> None:
        """Rows `ids` (unique) of table `kid` given values `data`, sent to their owners in chunks
        of at most `chunk_bytes`."""
        data = np.ascontiguousarray(data, table.dtype).reshape(len(ids), table.width)
        for s, positions in enumerate(table.placement.split(ids)):
            for chunk in row_chunks(len(positions), table.width, chunk_bytes):
                at = positions[chunk]
                self.link.request(s, P.Message(P.Type.INIT, key=kid, rows=ids[at], data=data[at].reshape(-1)))

    def push_rows(self, kid: int, table: TableLayout, ids: np.ndarray, data: Any, every_server: bool) -> None:
        """Rows `ids` (unique) of table `kid` pushed: one PUSH to each server owning some, or to
        every server (`every_server`: a synchronous job's rounds close on every server)."""
        data = np.ascontiguousarray(data, table.dtype).reshape(len(ids), table.width)
        with self.link.lock:  # one push's messages together, whichever thread pushes (a TensorFlow op's)
            for s, positions in enumerate(table.placement.split(ids)):
                if not len(positions) and not every_server:
                    continue  # travels only to the servers that own rows of it
                rows, part = ids[positions], data[positions].reshape(-1)
                self.push_bytes += rows.nbytes + part.nbytes
                self.link.push(s, P.Message(P.Type.PUSH, key=kid, rows=rows, data=part))

    def pull_rows(self, key: Hashable, kid: int, table: TableLayout, ids: np.ndarray, chunk_bytes: int) -> RowPull:
        """Rows `ids` (unique, sorted) of table `kid` asked of the servers that own them, in
        chunks of at most `chunk_bytes`; `gather` completes it."""
        pull = RowPull(key, table, ids)
        requests = []
        for s, positions in enumerate(table.placement.split(ids)):
            for chunk in row_chunks(len(positions), table.width, chunk_bytes):
                at = positions[chunk]
                self.pull_bytes += at.size * (8 + table.dtype.itemsize * table.width)
                requests.append((self.link.request(s, P.Message(P.Type.PULL, key=kid, rows=ids[at])), at))
        pull.expect(requests)
        return pull

    # -- the servers' optimizer state ----------------------------------------------------------

    def ask_state(self, layout: Layout) -> list[int]:
        """A dense key's optimizer state asked of each part's server (taken by `state`)."""
        return [self.link.request(part.server, P.Message(P.Type.GET_STATE, key=part.skey)) for part in layout.parts]

    def state(self, layout: Layout, seqs: list[int]) -> tuple[dict[str, np.ndarray], int]:
        """The state `ask_state` asked for, once answered (`link.settle`): {name: value}, count."""
        replies = [self.link.take(seq) for seq in seqs]
        names = replies[0].meta["names"]
        out = {}
        for j, name in enumerate(names):
            full = np.empty(layout.size, np.float32)
            for reply, part in zip(replies, layout.parts):
                full[part.start:part.end] = np.split(reply.data, len(names))[j]
            out[name] = full.reshape(layout.shape)
        return out, replies[0].meta["count"]

    def table_state_count(self, kid: int, table: TableLayout) -> list[tuple[list[str], int]]:
        """Each shard's state names and update count (asked with one row of each shard)."""
        got = []
        for s in range(self.count):
            if not table.placement.shard_rows(s):
                continue
            first = table.placement.global_ids(s, np.zeros(1, np.int64))
            seq = self.link.request(s, P.Message(P.Type.GET_STATE, key=kid, rows=first))
            self.link.wait([seq])
            reply = self.link.take(seq)
            got.append((reply.meta["names"], reply.meta["count"]))
        return got

    def table_state(self, kid: int, table: TableLayout, ids: np.ndarray, names: int, j: int,
                    chunk_bytes: int) -> np.ndarray:
        """State `j` (of `names`) of rows `ids` of table `kid`, asked of the servers owning them
        in requests of at most `chunk_bytes`, all sent before any answer is awaited."""
        out = np.empty((len(ids), table.width), np.float32)
        asked = []
        for s, positions in enumerate(table.placement.split(ids)):
            for chunk in row_chunks(len(positions), table.width, chunk_bytes, names):
                at = positions[chunk]
                asked.append((at, self.link.request(s, P.Message(P.Type.GET_STATE, key=kid, rows=ids[at]))))
        self.link.wait([seq for _, seq in asked])
        for at, seq in asked:
            out[at] = np.split(self.link.take(seq).data, names)[j].reshape(len(at), table.width)
        return out

    def set_state(self, layout: Layout, states: Sequence[np.ndarray], names: list[str], count: int) -> None:
        """A dense key's optimizer state (one flat array per name) sent to each part's server."""
        for part in layout.parts:
            data = np.concatenate([s[part.start:part.end] for s in states]) if names else None
            self.link.request(part.server, P.Message(P.Type.SET_STATE, key=part.skey, data=data,
                                                     meta={"count": count, "names": names}))

    def keep_feedback(self, layout: Layout, rank: int, what: str, flat: np.ndarray) -> None:
        """Worker `rank`'s error feedback `what` of a dense key (flat float32) sent to each part's
        server, which keeps it for worker 0's checkpoint (`kept_feedback`)."""
        for part in layout.parts:
            self.link.request(part.server, P.Message(P.Type.FEEDBACK, key=part.skey, meta={"rank": rank, "what": what},
                                                     data=np.ascontiguousarray(flat[part.start:part.end], np.float32)))

    def kept_feedback(self, layout: Layout, rank: int, what: str) -> np.ndarray:
        """What `keep_feedback` sent of worker `rank`, asked of each part's server, once answered."""
        meta = {"rank": rank, "what": what}
        seqs = [self.link.request(part.server, P.Message(P.Type.FEEDBACK, key=part.skey, meta=meta))
                for part in layout.parts]
        self.link.wait(seqs)
        flat = np.empty(layout.size, np.float32)
        for seq, part in zip(seqs, layout.parts):
            flat[part.start:part.end] = self.link.take(seq).data
        return flat

    def set_table_state(self, kid: int, table: TableLayout, ids: np.ndarray, states: Sequence[np.ndarray],
                        names: list[str], count: int, chunk_bytes: int) -> None:
        """Rows `ids` of table `kid`'s optimizer state (one (rows, width) array per name) sent to
        the servers owning them, in requests of at most `chunk_bytes`."""
        for s, positions in enumerate(table.placement.split(ids)):
            for chunk in row_chunks(len(positions), table.width, chunk_bytes, max(1, len(names))):
                rows = ids[positions[chunk]]
                data = np.concatenate([f[rows].reshape(-1) for f in states]) if names else None
                self.link.request(s, P.Message(P.Type.SET_STATE, key=kid, rows=rows, data=data,
                                               meta={"count": count, "names": names}))


def _payload(value: np.ndarray | Packed, i: int, part: Any) -> np.ndarray | tuple[np.ndarray, int]:
    """Part `i` of a key's push: its slice of the flat value, or its packed words and count."""
    if isinstance(value, Packed):
        return value.parts[i], part.end - part.start
    return value[part.start:part.end]
