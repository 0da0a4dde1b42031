"""The dist store's seams, each built alone (no sockets, no job): its keys (`Keys`: ids as MXNet
numbers them, layouts, tables) and a row pull completed as a dense pull is (`RowPull`: each
reply into its rows' place, a contiguous run a place a reply may land in)."""

import numpy as np
import pytest

from tfkv.ps import parts
from tfkv.ps.parts import RowPlacement, RowPull, TableLayout
from tfkv.store.base import KVStore
from tfkv.store.dist_keys import Keys
from tfkv.store.sparse import RowSparse, Table


class _Kinds(KVStore):
    """KVStore's own check of one kind of key per store, and its key phrases (nothing abstract is called)."""

    init = push = pull = set_optimizer = save_optimizer_states = load_optimizer_states = None


def _keys() -> Keys:
    store = object.__new__(_Kinds)
    return Keys(store._check_key, store.key_phrase)


def test_int_keys_are_their_own_ids_and_other_keys_are_numbered_in_init_order():
    keys = _keys()
    assert keys.id(7) == 7 and keys.id(7) == 7
    assert keys.id(-1) == parts.NAMED_KEY_BASE and keys.id(1 << 41) == parts.NAMED_KEY_BASE + 1
    with pytest.raises(ValueError, match="a store takes int keys or str keys, never both"):
        keys.id("w")
    assert keys.name(parts.NAMED_KEY_BASE) == "key -1"


def test_a_layout_is_found_for_an_initialised_key_only():
    keys = _keys()
    kid = keys.new("w")
    keys.layouts[kid] = parts.plan(kid, (3,), 1, 1 << 20, 1 << 20)
    assert keys.layout("w") == (kid, keys.layouts[kid])
    with pytest.raises(ValueError, match="already initialised"):
        keys.new("w")
    with pytest.raises(KeyError, match=r"key 'v' was not initialised; call init\('v', value\) first"):
        keys.layout("v")
    with pytest.raises(ValueError, match="row_sparse_pull"):  # a dense key asked for rows: refused, naming it
        keys.table("w")
    assert [(k, i, t) for k, i, _, t in keys] == [("w", kid, None)]


def test_a_table_keeps_its_shape_dtype_and_placement_and_a_row_sparse_init_its_merged_rows():
    keys = _keys()
    kid, spec, rows = keys.new_table("emb", Table((10, 2), init="uniform", scale=0.5, seed=3), 2, "hash")
    assert spec == {"init": "uniform", "scale": 0.5, "seed": 3} and rows is None
    assert keys.tables[kid] == TableLayout((10, 2), 2, RowPlacement(10, 2, "hash"), np.dtype(np.float32))
    assert keys.is_row_sparse("emb") and not keys.is_row_sparse("other")
    given = RowSparse(np.ones((3, 2), np.float32), np.array([4, 1, 4]), (6, 2))
    kid, spec, rows = keys.new_table("rs", given, 2, "range")
    assert spec["init"] == "zeros" and rows.indices.tolist() == [1, 4] and rows.data.tolist() == [[1, 1], [2, 2]]
    with pytest.raises(ValueError, match="already initialised"):
        keys.new_table("rs", given, 2, "range")


def test_a_row_pull_takes_each_reply_into_its_rows_place_and_offers_runs_to_land_in():
    table = TableLayout((8, 2), 2, RowPlacement(8, 2, "hash"), np.dtype(np.float32))
    ids = np.array([0, 1, 2, 5])
    pull = RowPull("emb", table, ids)
    split = table.placement.split(ids)  # server 0: rows 0, 2 (positions 0, 2); server 1: rows 1, 5 (1, 3)
    pull.expect([(11, split[0]), (12, split[1])])
    assert list(pull.destinations()) == []  # neither run is contiguous: no place to land in
    assert not pull.arrive(12, np.array([10, 11, 50, 51], np.float32))
    with pytest.raises(RuntimeError, match="a server answered 2 values for 2 rows"):
        bad = RowPull("emb", table, ids[:2])
        bad.expect([(1, np.arange(2))])
        bad.arrive(1, np.zeros(2, np.float32))
    assert pull.arrive(11, np.array([0, 1, 20, 21], np.float32))
    np.testing.assert_array_equal(pull.value, [[0, 1], [10, 11], [20, 21], [50, 51]])
    ranged = RowPull("emb", table._replace(placement=RowPlacement(8, 2, "range")), ids)
    ranged.expect([(21, np.arange(3)), (22, np.arange(3, 4))])
    (s0, d0), (s1, d1) = ranged.destinations()
    assert (s0, d0.size, s1, d1.size) == (21, 6, 22, 2)
    d0[...] = np.arange(6)  # a reply opened in its place (the secure transport's landing)
    ranged.landed = True
    assert not ranged.arrive(21, d0)
    assert ranged.arrive(22, np.array([7, 8], np.float32))
    np.testing.assert_array_equal(ranged.value, [[0, 1], [2, 3], [4, 5], [7, 8]])
