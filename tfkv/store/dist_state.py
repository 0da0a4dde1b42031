"""A dist store's optimizer state in one npz file: gathered from every server's key parts
(`save`), and handed back to them (`load`, worker 0 sends; the store's every worker waits at a
barrier). It is given the store's keys (tfkv.store.dist_keys.Keys) and its requests' builder
(tfkv.ps.kvworker.KVWorker).
The workers' own compression residuals and velocities go in beside it (`extra`). Under two-way
compression a dense key's state also holds the servers' weights (tfkv.ps.replies.STATE, which
the servers add to what they send), put back when the file has them (`kept`).

A row-sparse key's state (per row, as the servers keep it) is asked for and sent by rows, each
server's shard in requests of at most kvstore.chunk_bytes, and saved as the local store saves
it: one (rows, *row_shape) array per state, and the key's update count. Worker 0 never holds a
table's state whole: the file is written by row pieces as they arrive (tfkv.store.npz), read
back memory-mapped, and sent back one piece (about 64 MiB) in flight at a time."""

from __future__ import annotations

import functools
from typing import Any, Iterator

import numpy as np

from tfkv.ps.kvworker import KVWorker
from tfkv.ps.parts import TableLayout
from tfkv.store import npz
from tfkv.store.dist_keys import Keys


def save(keys: Keys, worker: KVWorker, state_names: list[str], chunk_bytes: int, fname: str,
         extra: dict[str, np.ndarray] | None = None) -> None:
    """Gather the optimizer state (`state_names`) of every key from the servers into one npz file,
    with the `extra` entries (this worker's error feedback)."""
    requests, tables = [], []
    for k, kid, layout, table in keys:
        if table is not None:  # after the dense keys: asked for by row pieces as the file is written
            tables.append((k, kid, table))
        else:
            requests.append((k, layout, worker.ask_state(layout)))
    worker.link.settle()
    out: dict[str, Any] = {}
    for k, layout, seqs in requests:
        states, count = worker.state(layout, seqs)
        for name, value in states.items():
            out[f"{k}/{name}"] = value
        out[f"{k}/count"] = np.asarray(count)
    for k, kid, table in tables:
        count = 0
        for names, shard_count in worker.table_state_count(kid, table):  # one row of each shard
            if names != state_names:
                raise RuntimeError(f"optimizer state of key {k!r}: the servers run an optimizer with states "
                                   f"{names}, this worker set one with {state_names}")
            # dist_async: a server counts the pushes that reached it (the most: the key's pushes)
            count = max(count, shard_count)
        for j, name in enumerate(state_names):
            out[f"{k}/{name}"] = npz.Chunked(table.shape, functools.partial(
                _state_pieces, worker, kid, table, len(state_names), j, chunk_bytes))
        out[f"{k}/count"] = np.asarray(count)
    npz.save(fname, {**out, **(extra or {})})


def _state_pieces(worker: KVWorker, kid: int, table: TableLayout, names: int, j: int,
                  chunk_bytes: int) -> Iterator[np.ndarray]:
    """State `j` of a table in consecutive row pieces of about npz.PIECE_BYTES (never whole on
    this worker), each asked of the servers owning its rows in requests of at most
    kvstore.chunk_bytes, all sent before any answer is awaited."""
    for start, end in npz.spans(table.shape[0], table.width * names):
        ids = np.arange(start, end, dtype=np.int64)
        yield worker.table_state(kid, table, ids, names, j, chunk_bytes).reshape((len(ids), *table.shape[1:]))


def load(keys: Keys, worker: KVWorker, names: list[str], chunk_bytes: int, fname: str,
         kept: tuple[str, ...] = ()) -> None:
    """Send every server its key parts' optimizer state (`names`, and of `kept` those the file
    holds for a dense key) from the npz file `save` wrote."""
    states = npz.load(fname)  # a table's states memory-mapped: sent by rows, never read whole
    for k, kid, layout, table in keys:
        count = int(states.get(f"{k}/count", 0))
        if table is not None:
            full = [_entry(states, k, n, table.shape).reshape(table.shape[0], table.width) for n in names]
            for start, end in npz.spans(table.shape[0], table.width * max(1, len(names))):
                worker.set_table_state(kid, table, np.arange(start, end, dtype=np.int64), full, names, count,
                                       chunk_bytes)
                worker.link.settle()  # one piece in flight at a time: never the whole state queued here
            continue
        given = [*names, *(n for n in kept if f"{k}/{n}" in states)]
        worker.set_state(layout, [states[f"{k}/{n}"].reshape(-1) for n in given], given, count)


def _entry(states: dict[str, np.ndarray], key: Any, name: str, shape: tuple[int, ...]) -> np.ndarray:
    value = states.get(f"{key}/{name}")
    if value is None or tuple(value.shape) != tuple(shape):
        got = "no entry" if value is None else f"an entry of shape {tuple(value.shape)}"
        raise ValueError(f"optimizer state of key {key!r}: {got} {key}/{name}, expected {tuple(shape)}: was it saved "
                         "for another model or another optimizer?")
    return np.asarray(value, np.float32)
