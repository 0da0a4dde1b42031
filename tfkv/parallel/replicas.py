"""The copies of a data-parallel model, one per device: their trainable variables as the store's
dense keys (the row-sparse tables' keys after them), where the updates happen (the store, or an
updater per copy), and the weights written into every copy. What moves the gradients between
them and the store is an exchange's (`tfkv.parallel.exchange`)."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import tensorflow as tf

from tfkv import optim
from tfkv.errors import ConfigError
from tfkv.layers import serving_rows
from tfkv.parallel import sparse
from tfkv.store.base import KVStore
from tfkv.store.tf_updater import TFUpdater


class Replicas:
    """`models[i]` built on `devices[i]`; `params[i][k]`: key k's variable in copy i;
    `sparse`: the row-sparse tables (tfkv.parallel.sparse.Tables) or None."""

    def __init__(self, build_model: Callable[[], Any], devices: Sequence[str], store: KVStore,
                 update_on_kvstore: bool, row_sparse: bool) -> None:
        self.devices = list(devices)
        self.store = store
        self.models = []
        with serving_rows():  # a ShardedEmbedding holds the batch's rows, the store its table
            for d in self.devices:
                with tf.device(d):
                    self.models.append(build_model())
        found = sparse.find(self.models, row_sparse, first_key=0)
        # With one device on one machine there is nothing to sum: MXNet leaves the store out.
        self.uses_store = len(self.devices) > 1 or store.distributed or bool(found)
        self.update_on_kvstore = update_on_kvstore and self.uses_store
        if found and not self.update_on_kvstore:
            raise ConfigError(f"the embedding tables {', '.join(t.name for t in found)} are row-sparse keys of the "
                              "store, which updates their rows: set kvstore.update_on_kvstore=true")
        table_vars = {id(t.variable(r)) for t in found for r in range(len(self.models))}
        self.params = [[v for v in m.trainable_variables if id(v) not in table_vars] for m in self.models]
        self.keys = list(range(len(self.params[0])))
        for j, t in enumerate(found):
            t.key = len(self.keys) + j
        self.sparse = sparse.Tables(found, self.models, store) if found else None
        self.tables: list[sparse.SparseTable] = found  # empty without row-sparse tables
        self.updaters: list[TFUpdater] = []  # when the workers update: one per copy of the weights

    def start(self, optimizer: optim.Optimizer, tables: dict[int, Any], evaluate_only: bool) -> None:
        """The optimizer where updates happen, every copy from the first one's weights, the
        tables put in the store (`tables`: their initial weights by index, where given)."""
        store = self.store
        if self.update_on_kvstore:
            store.set_optimizer(optimizer)
        else:
            for d, params in zip(self.devices, self.params):
                updater = TFUpdater(optimizer)
                for k in self.keys:
                    updater.create_state(k, params[k], d)
                self.updaters.append(updater)
        if self.uses_store:
            # Every copy starts from the first one's weights (MXNet: init, then pull everywhere).
            for k in self.keys:
                store.broadcast(k, self.params[0][k], out=[p[k] for p in self.params], priority=-k)
        if self.sparse is not None:
            self.sparse.init({j: v for j, v in tables.items() if v is not None}, read_only=evaluate_only)
        self.sync_state(source=0)

    def table_variables(self, r: int) -> list[Any]:
        """Copy `r`'s row-sparse tables' trainable variables (after its dense keys' in backprop)."""
        return [t.variable(r) for t in self.tables]

    # -- weights into every copy (traceable) ----------------------------------------------------

    def assign_all(self, weights: list[Any]) -> None:
        """Pulled weights, one per key, into every copy."""
        for k, w in zip(self.keys, weights):
            for d, params in zip(self.devices, self.params):
                with tf.device(d):
                    params[k].assign(w)

    def apply_aggregated(self, grads: list[Any]) -> None:
        """Summed gradients, one per key, applied by every copy's own updater."""
        for k, g in zip(self.keys, grads):
            self.update_copies(k, g)

    def update_copies(self, k: int, aggregated: Any) -> None:
        for d, params, updater in zip(self.devices, self.params, self.updaters):
            with tf.device(d):
                updater.update(k, params[k], tf.identity(aggregated))

    # -- state that gradients do not move --------------------------------------------------------

    def copies_of_state(self) -> list[list[Any]]:
        """Per non-trainable variable, its copies; a ShardedEmbedding's row ids are the rows'
        (loaded with them), not state."""
        own = self.sparse.is_table_variable if self.sparse is not None else (lambda v: False)
        return [list(vs) for vs in zip(*(m.non_trainable_variables for m in self.models)) if not own(vs[0])]

    def sync_state(self, source: int | None) -> None:
        """Every copy's non-trainable state set to copy `source`'s, or (None) to their average."""
        if len(self.models) == 1:
            return
        for vs in self.copies_of_state():
            value = vs[source].numpy() if source is not None else np.mean([v.numpy() for v in vs], axis=0)
            for v in vs:
                v.assign(value)
