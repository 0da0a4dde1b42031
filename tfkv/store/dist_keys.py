"""A dist store's keys (`tfkv.store.dist.DistStore.keys`): each key's id on the servers and
what it is there, a dense key's layout (`tfkv.ps.parts.Layout`) or a table's
(`tfkv.ps.parts.TableLayout`, a row-sparse key sharded by rows over every server).

An int key in [0, 2**40) is its own id (so `key * 9973 % servers` places it as in MXNet); any
other key (a str, a negative or a larger int) takes the next id from 2**40 in init order, which
every worker shares, as MXNet numbers its str keys. So two distinct keys never share an id.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Iterator

import numpy as np

from tfkv.ps import parts
from tfkv.ps.parts import Layout, RowPlacement, TableLayout
from tfkv.store import sparse
from tfkv.store.sparse import RowSparse, Table

Key = Hashable


class Keys:
    """The ids, layouts and tables of a store's keys. `check` refuses a key of another kind than
    the store's (KVStore._check_key), `phrase` names a key in a message (KVStore.key_phrase)."""

    def __init__(self, check: Callable[[Key], None], phrase: Callable[[Key], str]):
        self.check, self.phrase = check, phrase
        self.ids: dict[Key, int] = {}
        self.layouts: dict[int, Layout] = {}  # dense keys, by id
        self.tables: dict[int, TableLayout] = {}  # row-sparse keys, by id
        self._named = 0  # keys numbered from parts.NAMED_KEY_BASE so far

    def id(self, key: Key) -> int:
        """The key's id on the servers, the same on every worker (given at its first use)."""
        self.check(key)
        kid = self.ids.get(key)
        if kid is None:
            if isinstance(key, (int, np.integer)) and 0 <= int(key) < parts.NAMED_KEY_BASE:
                kid = int(key)
            else:
                kid = parts.NAMED_KEY_BASE + self._named
                if kid >> parts.CHUNK_SHIFT:
                    raise ValueError(f"key {key!r}: more than {(1 << parts.CHUNK_SHIFT) - parts.NAMED_KEY_BASE} keys")
                self._named += 1
            self.ids[key] = kid
        return kid

    def name(self, kid: int) -> str:
        """What messages call key id `kid`: its key as the caller gave it, or the name given it."""
        return self.phrase(next((k for k, i in self.ids.items() if i == kid), kid))

    def new(self, key: Key) -> int:
        """The id of `key`, about to be initialised; ValueError if it was already."""
        kid = self.id(key)
        if kid in self.layouts or kid in self.tables:
            raise ValueError(f"key {key!r} is already initialised")
        return kid

    def layout(self, key: Key) -> tuple[int, Layout]:
        """(id, layout) of an initialised dense key; KeyError naming it otherwise."""
        kid = self.ids.get(key) if type(key) is int or type(key) is str else None
        layout = self.layouts.get(kid)  # type: ignore[arg-type]
        if layout is not None:  # an initialised key of exactly int or str: of this store's kind (checked at init)
            return kid, layout  # type: ignore[return-value]
        self.check(key)
        kid = self.ids.get(key)
        if kid is None or kid not in self.layouts:
            raise KeyError(f"key {key!r} was not initialised; call init({key!r}, value) first")
        return kid, self.layouts[kid]

    def is_row_sparse(self, key: Key) -> bool:
        kid = self.ids.get(key) if isinstance(key, (int, str, np.integer)) else None
        return kid is not None and kid in self.tables

    def table(self, key: Key, what: str = "sparse_pull") -> tuple[int, TableLayout]:
        """(id, table) of an initialised row-sparse key; `what` refused for a dense one."""
        kid = self.ids.get(key) if isinstance(key, (int, str, np.integer)) else None
        table = self.tables.get(kid)  # type: ignore[arg-type]
        if table is None:
            if kid is not None and kid in self.layouts:
                raise sparse.refused(what, key)
            self.check(key)
            raise KeyError(f"key {key!r} was not initialised; call init({key!r}, value) first")
        return kid, table  # type: ignore[return-value]

    def new_table(self, key: Key, value: Any, servers: int, sharding: str) -> tuple[int, dict, RowSparse | None]:
        """Make `key` a table from its init value (a Table or a RowSparse): its id, its
        description for the servers, and the rows (merged) a RowSparse gives them."""
        self.check(key)
        if key in self.ids:
            raise ValueError(f"key {key!r} is already initialised")
        if isinstance(value, Table):
            dtype = np.dtype(value.dtype)
            shape, rows, spec = value.shape, None, {"init": value.init, "scale": float(value.scale),
                                                    "seed": int(value.seed) % (1 << 63)}
        else:
            given = RowSparse.of(value)
            dtype = sparse.check_table_dtype(key, np.asarray(given.data).dtype)
            rows = sparse.check_rows(key, given, given.shape, dtype, what="init")  # on every worker: the same refusals
            shape, spec = given.shape, {"init": "zeros", "scale": 0.0, "seed": 0}
        if len(shape) < 1 or shape[0] < 1:
            raise ValueError(f"init of key {key!r}: a table of shape {shape}; give (rows, *row_shape)")
        width = int(np.prod(shape[1:], dtype=np.int64))
        placement = RowPlacement(shape[0], servers, sharding)
        kid = self.id(key)  # once the value was found good: a refused init leaves no key behind
        self.tables[kid] = TableLayout(tuple(shape), width, placement, dtype)
        return kid, spec, None if rows is None else rows.merged()

    def __iter__(self) -> Iterator[tuple[Key, int, Layout | None, TableLayout | None]]:
        """(key, id, layout, table) of each initialised key, in init order (one of the two None)."""
        for key, kid in self.ids.items():
            layout, table = self.layouts.get(kid), self.tables.get(kid)
            if layout is not None or table is not None:  # not an id given to a key whose init was refused
                yield key, kid, layout, table
