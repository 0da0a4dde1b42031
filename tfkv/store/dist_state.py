"""A dist store's (tfkv.store.dist.DistStore, passed in) optimizer state in one npz file: gathered from every server's key parts
(`save`), and handed back to them (`load`, worker 0 sends, every worker waits at the barrier).
Each worker's compression residuals and velocities are its own and not in it."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from tfkv.ps import protocol as P


def save(store: Any, fname: str) -> None:
    """Gather the optimizer state of every key from the servers into one npz file."""
    requests = []
    for k, kid in store._ids.items():
        layout = store._layouts[kid]
        requests.append((k, layout, [store.servers.request(part.server, P.Message(P.Type.GET_STATE, key=part.skey))
                                     for part in layout.parts]))
    store.servers.settle()
    out: dict[str, np.ndarray] = {}
    for k, layout, seqs in requests:
        replies = [store.servers.take(seq) for seq in seqs]
        names = replies[0].meta["names"]
        for j, name in enumerate(names):
            full = np.empty(layout.size, np.float32)
            for reply, part in zip(replies, layout.parts):
                full[part.start:part.end] = np.split(reply.data, len(names))[j]
            out[f"{k}/{name}"] = full.reshape(layout.shape)
        out[f"{k}/count"] = np.asarray(replies[0].meta["count"])
    np.savez(fname, **out)


def load(store: Any, fname: str) -> None:
    """Send every server its key parts' optimizer state from the npz file `save` wrote."""
    if store.rank == 0 and store._sender is not None:
        logging.getLogger("tfkv").warning(
            "gradient compression %s: each worker's %s are not in the optimizer state; they start from zero, "
            "so the updates from here differ from those of a job never stopped", store._sender.setting.kind.name,
            store._sender.held)
    if store.rank == 0:
        with np.load(fname, allow_pickle=False) as f:
            states = {n: f[n] for n in f.files}
        for k, kid in store._ids.items():
            layout = store._layouts[kid]
            names = list(store._optimizer.state_names) if store._optimizer else []
            count = int(states.get(f"{k}/count", 0))
            for part in layout.parts:
                data = (np.concatenate([states[f"{k}/{n}"].reshape(-1)[part.start:part.end] for n in names])
                        if names else None)
                store.servers.request(part.server, P.Message(P.Type.SET_STATE, key=part.skey, data=data,
                                                             meta={"count": count, "names": names}))
    store.barrier()
