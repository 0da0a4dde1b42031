"""A data-parallel model's weights as the model built without a store has them: the
`PortableWeights` part of `tfkv.parallel.data_parallel.DataParallel`. A row-sparse table lives in
the store and a ShardedEmbedding holds only a batch's rows, so the first copy's variables are
mapped back to the model's own list (the cache stands for its table, its row ids are left out)
for checkpoints, export and initial weights."""

from __future__ import annotations

from typing import Any

import numpy as np

from tfkv.store import npz


class PortableWeights:
    """Mixed into DataParallel, whose `replicas` and `sparse` (tfkv.parallel.sparse.Tables or
    None) it reads."""

    def get_weights(self) -> list[np.ndarray]:
        """All variables of the first copy, in `model.weights` order: those of the model as built
        without a store, so a row-sparse table is gathered whole from the store."""
        return [np.concatenate(list(npz.pieces(w))) if isinstance(w, npz.Chunked) else w
                for w in self.streamed_weights()]

    def streamed_weights(self) -> list[Any]:
        """`get_weights`, but each row-sparse table an `npz.Chunked`: its rows pulled from the
        store piece by piece as they are written (what a checkpoint saves)."""
        if self.sparse is None:
            return [np.asarray(w) for w in self.replicas[0].get_weights()]
        return [np.asarray(v.numpy()) if j is None else self.sparse.rows_of(self.sparse.tables[j])
                for v, j in self._portable()]

    def weight_names(self) -> list[str]:
        return [f"{i:04d}/{v.path}" for i, (v, _) in enumerate(self._portable())]

    def _portable(self) -> list[tuple[Any, int | None]]:
        """(variable of the first copy, its table's index or None) for each weight of the model
        as built without a store (a ShardedEmbedding's cache stands for its table; its row ids
        are left out)."""
        tables = self.sparse.tables if self.sparse is not None else []
        out = []
        for v in self.replicas[0].weights:
            j = next((j for j, t in enumerate(tables) if v is t.variable(0)), None)
            if j is None and any(t.sharded and v is t.copies[0].row_ids for t in tables):
                continue
            out.append((v, j))
        return out

    def _set_portable_weights(self, weights: list[np.ndarray]) -> dict[int, np.ndarray]:
        """`weights` (get_weights' form) into the first copy; returns the tables' (by index)."""
        slots = self._portable()
        if len(weights) != len(slots):
            raise ValueError(f"{len(weights)} weights for a model of {len(slots)} variables")
        tables = {}
        for (v, j), w in zip(slots, weights):
            if j is None:
                v.assign(w)
            else:
                tables[j] = w
        return tables
