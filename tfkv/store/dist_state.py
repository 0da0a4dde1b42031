"""A dist store's (tfkv.store.dist.DistStore, passed in) optimizer state in one npz file: gathered from every server's key parts
(`save`), and handed back to them (`load`, worker 0 sends, every worker waits at the barrier).
Each worker's compression residuals and velocities are its own and not in it.

A row-sparse key's state (per row, as the servers keep it) is asked for and sent by rows, each
server's shard in requests of at most kvstore.chunk_bytes, and saved as the local store saves
it: one (rows, *row_shape) array per state, and the key's update count. Worker 0 never holds a
table's state whole: the file is written by row pieces as they arrive (tfkv.store.npz), read
back memory-mapped, and sent back one piece (about 64 MiB) in flight at a time."""

from __future__ import annotations

import functools
import logging
from typing import Any, Iterator

import numpy as np

from tfkv.ps import protocol as P
from tfkv.ps.parts import row_chunks
from tfkv.store import npz


def save(store: Any, fname: str) -> None:
    """Gather the optimizer state of every key from the servers into one npz file."""
    requests, tables = [], []
    state_names = list(store._optimizer.state_names)
    for k, kid in store._ids.items():
        table = store._tables.get(kid)
        if table is not None:  # after the dense keys: asked for by row pieces as the file is written
            tables.append((k, kid, table))
            continue
        layout = store._layouts.get(kid)
        if layout is None:  # an id given to a key whose init was refused
            continue
        requests.append((k, layout, [store.servers.request(part.server, P.Message(P.Type.GET_STATE, key=part.skey))
                                     for part in layout.parts]))
    store.servers.settle()
    out: dict[str, Any] = {}
    for k, layout, seqs in requests:
        replies = [store.servers.take(seq) for seq in seqs]
        names = replies[0].meta["names"]
        for j, name in enumerate(names):
            full = np.empty(layout.size, np.float32)
            for reply, part in zip(replies, layout.parts):
                full[part.start:part.end] = np.split(reply.data, len(names))[j]
            out[f"{k}/{name}"] = full.reshape(layout.shape)
        out[f"{k}/count"] = np.asarray(replies[0].meta["count"])
    for k, kid, table in tables:
        count = 0
        for s in range(store.servers.count):  # one row of each shard: its update count
            if not table.placement.shard_rows(s):
                continue
            first = table.placement.global_ids(s, np.zeros(1, np.int64))
            seq = store.servers.request(s, P.Message(P.Type.GET_STATE, key=kid, rows=first))
            store.servers.wait([seq])
            reply = store.servers.take(seq)
            if reply.meta["names"] != state_names:
                raise RuntimeError(f"optimizer state of key {k!r}: the servers run an optimizer with states "
                                   f"{reply.meta['names']}, this worker set one with {state_names}")
            # dist_async: a server counts the pushes that reached it (the most: the key's pushes)
            count = max(count, reply.meta["count"])
        for j, name in enumerate(state_names):
            out[f"{k}/{name}"] = npz.Chunked(table.shape, functools.partial(_state_pieces, store, kid, table, j))
        out[f"{k}/count"] = np.asarray(count)
    npz.save(fname, out)


def _state_pieces(store: Any, kid: int, table: Any, j: int) -> Iterator[np.ndarray]:
    """State `j` of a table in consecutive row pieces of about npz.PIECE_BYTES (never whole on
    this worker), each asked of the servers owning its rows in requests of at most
    kvstore.chunk_bytes, all sent before any answer is awaited."""
    names = len(store._optimizer.state_names)
    for start, end in npz.spans(table.shape[0], table.width * names):
        ids = np.arange(start, end, dtype=np.int64)
        out = np.empty((len(ids), table.width), np.float32)
        asked = []
        for s, positions in enumerate(table.placement.split(ids)):
            for chunk in row_chunks(len(positions), table.width, store.env.chunk_bytes, names):
                at = positions[chunk]
                asked.append((at, store.servers.request(s, P.Message(P.Type.GET_STATE, key=kid, rows=ids[at]))))
        store.servers.wait([seq for _, seq in asked])
        for at, seq in asked:
            out[at] = np.split(store.servers.take(seq).data, names)[j].reshape(len(at), table.width)
        yield out.reshape((len(ids), *table.shape[1:]))


def load(store: Any, fname: str) -> None:
    """Send every server its key parts' optimizer state from the npz file `save` wrote."""
    if store.rank == 0 and store._sender is not None:
        logging.getLogger("tfkv").warning(
            "gradient compression %s: each worker's %s are not in the optimizer state; they start from zero, "
            "so the updates from here differ from those of a job never stopped", store._sender.setting.kind.name,
            store._sender.held)
    # Every worker's pushes so far applied first: a round still open (another worker's push on its
    # way) would otherwise close after the state was put back, and move it again.
    store.barrier()
    if store.rank == 0:
        states = npz.load(fname)  # a table's states memory-mapped: sent by rows, never read whole
        for k, kid in store._ids.items():
            names = list(store._optimizer.state_names) if store._optimizer else []
            count = int(states.get(f"{k}/count", 0))
            table = store._tables.get(kid)
            if table is not None:
                full = [_entry(states, k, n, table.shape).reshape(table.shape[0], table.width) for n in names]
                for start, end in npz.spans(table.shape[0], table.width * max(1, len(names))):
                    ids = np.arange(start, end, dtype=np.int64)
                    for s, positions in enumerate(table.placement.split(ids)):
                        for chunk in row_chunks(len(positions), table.width, store.env.chunk_bytes, max(1, len(names))):
                            rows = ids[positions[chunk]]
                            data = np.concatenate([f[rows].reshape(-1) for f in full]) if names else None
                            store.servers.request(s, P.Message(P.Type.SET_STATE, key=kid, rows=rows, data=data,
                                                               meta={"count": count, "names": names}))
                    store.servers.settle()  # one piece in flight at a time: never the whole state queued here
                continue
            layout = store._layouts.get(kid)
            if layout is None:
                continue
            for part in layout.parts:
                data = (np.concatenate([states[f"{k}/{n}"].reshape(-1)[part.start:part.end] for n in names])
                        if names else None)
                store.servers.request(part.server, P.Message(P.Type.SET_STATE, key=part.skey, data=data,
                                                             meta={"count": count, "names": names}))
    store.barrier()


def _entry(states: dict[str, np.ndarray], key: Any, name: str, shape: tuple[int, ...]) -> np.ndarray:
    value = states.get(f"{key}/{name}")
    if value is None or tuple(value.shape) != tuple(shape):
        got = "no entry" if value is None else f"an entry of shape {tuple(value.shape)}"
        raise ValueError(f"optimizer state of key {key!r}: {got} {key}/{name}, expected {tuple(shape)}: was it saved "
                         "for another model or another optimizer?")
    return np.asarray(value, np.float32)
