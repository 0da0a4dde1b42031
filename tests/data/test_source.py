"""tfkv.data.Source: a data factory's result sharded, batched and counted the same way on every
worker, whatever the factory does itself (declared by the parameters it takes)."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import tensorflow as tf

from tfkv.data import Source, Split
from tfkv.errors import ConfigError, DataError

CALLS: list[dict] = []


def examples(split: str):
    n = 103 if split == "train" else 10
    return tf.data.Dataset.from_tensor_slices((np.arange(n, dtype=np.float32)[:, None], np.arange(n) % 3))


def unknown_length(split: str):
    """A generator: tf.data cannot know its length without reading it."""
    n = 50 if split == "train" else 10
    return tf.data.Dataset.from_generator(
        lambda: ((np.float32([i]), i % 2) for i in range(n)),
        output_signature=(tf.TensorSpec([1], tf.float32), tf.TensorSpec([], tf.int64)))


def uneven_shards(split: str, rank: int, num_workers: int, batch_size: int):
    """Shards itself, unevenly: rank 0 gets 40 examples, rank 1 only 25."""
    CALLS.append({"split": split, "rank": rank})
    n = {0: 40, 1: 25}[rank] if split == "train" else 10
    return tf.data.Dataset.from_tensor_slices((np.full((n, 1), rank, np.float32), np.zeros(n, np.int64))).batch(
        batch_size, drop_remainder=split == "train")


def epoch_order(split: str, seed: int, epoch: int):
    order = np.random.default_rng([seed, epoch]).permutation(20)
    return tf.data.Dataset.from_tensor_slices((order[:, None].astype(np.float32), order % 2))


def arrays(split: str):
    n = 64 if split == "train" else 16
    return np.arange(n * 2, dtype=np.float32).reshape(n, 2), (np.arange(n) % 5).astype(np.int64)


def with_classes(split: str):
    return Split(examples(split), num_classes=7)


def not_pairs(split: str):
    return tf.data.Dataset.from_tensor_slices(np.zeros((4, 2), np.float32))


def batched(split: str, batch_size: int):
    """Batches itself, shards nothing."""
    return examples(split).batch(batch_size)


def dealt(split: str, rank: int, num_workers: int):
    """Shards itself: round robin, every example in one shard (the test split's rule)."""
    return examples(split).shard(num_workers, rank)


@pytest.fixture(autouse=True, scope="module")
def package():
    module = types.ModuleType("sourcepkg")
    for f in (examples, unknown_length, uneven_shards, epoch_order, arrays, with_classes, not_pairs, batched, dealt):
        setattr(module, f.__name__, f)
    sys.modules["sourcepkg"] = module
    yield
    del sys.modules["sourcepkg"]


def xs(data) -> list[float]:
    return [float(v) for x, _ in data for v in np.asarray(x).ravel()]


def test_tfkv_shards_a_factory_that_does_not_disjointly_and_every_worker_runs_the_same_steps() -> None:
    node = {"_target_": "sourcepkg.examples"}
    sources = [Source(node, 0, 8, 100, num_workers=3, rank=r) for r in range(3)]
    assert {s.steps for s in sources} == {103 // 3 // 8}  # the smallest shard's full batches: 4
    seen = [xs(s.train(1)) for s in sources]
    assert all(len(v) == 4 * 8 for v in seen)
    flat = [v for part in seen for v in part]
    assert len(flat) == len(set(flat))  # disjoint
    assert xs(sources[0].test()) == list(range(10))  # every worker: the whole test split, in order


@pytest.mark.parametrize("factory, n", [("examples", 10), ("arrays", 16), ("batched", 10), ("dealt", 10)])
@pytest.mark.parametrize("parts", [2, 3])
def test_the_parts_of_the_test_split_hold_every_example_once(factory: str, n: int, parts: int) -> None:
    """What each worker of a job evaluates (tfkv.parallel.base.Parallel.evaluate_split)."""
    source = Source({"_target_": f"sourcepkg.{factory}"}, 0, 4, 4, num_workers=parts, rank=0)
    shares = [xs(source.test(parts, i)) for i in range(parts)]
    whole = xs(source.test())  # (1, 0): the whole split, in order
    assert len(whole) == n * (2 if factory == "arrays" else 1) and len(set(whole)) == len(whole)
    assert sorted(v for share in shares for v in share) == sorted(whole)
    assert max(map(len, shares)) - min(map(len, shares)) <= (8 if factory == "arrays" else 4)  # balanced


def test_unknown_cardinality_is_counted_once() -> None:
    s = Source({"_target_": "sourcepkg.unknown_length"}, 0, 8, 4, num_workers=2, rank=1)
    assert s.steps == 25 // 8
    assert len(list(s.train(1))) == s.steps and len(list(s.train(2))) == s.steps
    assert [len(x) for x, _ in s.test()] == [4, 4, 2]


def test_a_self_sharding_factory_gets_the_fewest_batches_of_any_rank() -> None:
    CALLS.clear()
    s = Source({"_target_": "sourcepkg.uneven_shards"}, 0, 10, 5, num_workers=2, rank=0)
    assert s.steps == 2  # rank 1 holds 25 examples: 2 full batches; rank 0's 4 would hang it
    assert {c["rank"] for c in CALLS if c["split"] == "train"} == {0, 1}
    batches = list(s.train(1))
    assert len(batches) == 2 and all(float(x[0, 0]) == 0.0 for x, _ in batches)
    assert s.input_spec.shape == (1,)  # batched by the factory: the spec without the batch axis


def test_a_factory_that_takes_seed_and_epoch_orders_each_epoch_itself() -> None:
    s = Source({"_target_": "sourcepkg.epoch_order"}, 3, 4, 4)
    one, two = xs(s.train(1)), xs(s.train(2))
    assert sorted(one) == sorted(two) and one != two
    assert one == xs(Source({"_target_": "sourcepkg.epoch_order"}, 3, 4, 4).train(1))


def test_arrays_are_shuffled_per_epoch_and_sharded() -> None:
    s0 = Source({"_target_": "sourcepkg.arrays"}, 0, 4, 16, num_workers=2, rank=0)
    s1 = Source({"_target_": "sourcepkg.arrays"}, 0, 4, 16, num_workers=2, rank=1)
    assert s0.num_classes == 5 and s0.steps == 8
    a, b = xs(s0.train(1)), xs(s1.train(1))
    assert not set(a) & set(b) and xs(s0.train(2)) != a


def test_split_says_the_number_of_classes_and_the_node_may_say_it_too() -> None:
    assert Source({"_target_": "sourcepkg.with_classes"}, 0, 8, 8).num_classes == 7
    assert Source({"_target_": "sourcepkg.examples", "num_classes": 3}, 0, 8, 8).num_classes == 3


@pytest.mark.parametrize("node, words", [
    ({"_target_": "sourcepkg.not_pairs"}, ["not (x, y) pairs"]),
    ({"_target_": "sourcepkg.examples", "size": 3}, ["dataset.size", "not an argument"]),
    ({"_target_": "sourcepkg.examples", "rank": 1}, ["dataset.rank", "provided by tfkv"]),
    ({"_target_": "sourcepkg.nope"}, ["dataset._target_", "no 'nope'"]),
])
def test_a_factory_that_does_not_fit_is_one_line(node: dict, words: list[str]) -> None:
    with pytest.raises((ConfigError, DataError)) as e:
        Source(node, 0, 8, 8)
    assert "\n" not in str(e.value)
    for word in words:
        assert word in str(e.value)


def test_a_shard_without_a_full_batch_is_refused() -> None:
    with pytest.raises(DataError, match="no full batch"):
        Source({"_target_": "sourcepkg.examples"}, 0, 64, 8, num_workers=2, rank=0)
