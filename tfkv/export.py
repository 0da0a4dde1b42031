"""What a run leaves for use outside tfkv, and evaluating a checkpoint without training.

`model.keras` in the run directory is the trained model saved by Keras itself, loadable with
`keras.models.load_model` where tfkv is not installed. It takes the inputs as the data set holds
them: where tfkv's pipeline scales a data set's inputs (raw pixels to [0, 1], its training
split's mean and standard deviation), the model starts with the same steps as Keras layers
(`tfkv.models.input_scaling`). A layer of one of tfkv's own classes (the
LSTM model's Embedding, whose gradient is dense for the stores) is saved as the Keras class it
extends, from the same config with the same weights: it computes the same outputs (a
`tfkv.layers.ShardedEmbedding` is saved as the `keras.layers.Embedding` it extends, with the whole
table: its `keras_config`; tfkv gathers the table from the store first). Layers of the
user's own classes stay theirs: loading those needs the user's package, as Keras requires for
any custom layer. `export.saved_model=true` also writes `saved_model/` (Keras' `model.export`),
a TensorFlow SavedModel whose `serve` endpoint takes a batch of inputs, for TF Serving.

The chief worker writes both after the last epoch (not at each checkpoint: the checkpoint holds
the same weights, and `eval_only=true resume=<checkpoint>` exports any of them). An eval_only run
evaluates the checkpoint on the test split with the training's own evaluation, writes
metrics.json and exports the checkpoint's model into its own run directory.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import zipfile
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from tfkv.errors import ConfigError, OutputError, unwritable

MODEL_FILE = "model.keras"
SAVED_MODEL_DIR = "saved_model"

log = logging.getLogger("tfkv")


def _keras_class(cls: type) -> type:
    """The nearest class of `cls`'s ancestry that is not tfkv's own (`cls` when it is not)."""
    return next(c for c in cls.__mro__ if not c.__module__.split(".")[0] == "tfkv")


def portable(model: Any) -> Any:
    """`model`, or a copy with the same weights whose layers are all of classes outside tfkv."""
    import keras

    if all(_keras_class(type(layer)) is type(layer) for layer in model._flatten_layers()):
        return model  # also a subclassed model, which clone_model cannot clone
    copy = keras.models.clone_model(
        model, recursive=True,
        clone_function=lambda layer: _keras_class(type(layer)).from_config(_keras_config(layer)))
    copy.set_weights(model.get_weights())
    return copy


def _keras_config(layer: Any) -> dict[str, Any]:
    """The config of the Keras class a layer is saved as: its `keras_config()` where it has one
    (a config without tfkv's own keys), else its config."""
    keras_config = getattr(layer, "keras_config", None)
    return keras_config() if callable(keras_config) and type(layer).__module__.startswith("tfkv") else layer.get_config()


def save(model: Any, run_dir: Path, saved_model: bool = False) -> Path:
    """`run_dir`/model.keras (and saved_model/ when asked), each written under a temporary name
    and renamed, so a crash never leaves half a model where a user would load it."""
    run_dir = Path(run_dir)
    model = portable(model)
    target = run_dir / MODEL_FILE
    tmp = run_dir / f".tmp-{MODEL_FILE}"  # Keras wants the .keras suffix

    def write_keras() -> None:
        try:
            model.save(tmp)
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)

    written(write_keras, target)
    if saved_model:
        folder, tmp_dir = run_dir / SAVED_MODEL_DIR, run_dir / f".tmp-{SAVED_MODEL_DIR}"

        def write_saved_model() -> None:
            tf_log = logging.getLogger("tensorflow")
            level = tf_log.level
            tf_log.setLevel(logging.WARNING)  # its "Assets written to" names the temporary folder
            try:
                model.export(str(tmp_dir), verbose=False)
                shutil.rmtree(folder, ignore_errors=True)
                os.replace(tmp_dir, folder)
            finally:
                tf_log.setLevel(level)
                shutil.rmtree(tmp_dir, ignore_errors=True)

        written(write_saved_model, folder)
    return target


def write(cfg: Any, source: Any, weights: Sequence[Any], run_dir: Path) -> Path:
    """Build the model `cfg.model` describes, give it `weights` (every variable, in `model.weights`
    order, as a checkpoint holds them) and save it into `run_dir`. Data and model parallelism both
    end here: a layer-group builder's `build` chains the groups with the weights in this order.
    A ShardedEmbedding's table (a checkpoint's, memory-mapped) is written by rows, never whole
    in memory, unless a SavedModel is asked for too (TensorFlow's export needs the variables)."""
    from tfkv import models
    from tfkv.layers import ShardedEmbedding, serving_rows
    from tfkv.models import input_scaling

    def build() -> Any:
        return models.build(cfg.model, input_shape=source.input_shape, input_spec=source.input_spec,
                            num_classes=source.outputs)

    def scaled(model: Any) -> Any:  # takes the inputs as the data set holds them (see input_scaling)
        return input_scaling.wrap(model, source.input_scaling, source.input_spec)

    if not cfg.export.saved_model:
        with serving_rows():  # each ShardedEmbedding a cache of rows: its table is written by rows
            model = build()
        if any(isinstance(layer, ShardedEmbedding) for layer in model._flatten_layers()):
            path = save_by_rows(scaled(model), list(weights), run_dir)
            log.info("model saved: %s (its tables written by rows)", path)
            return path
    model = build()
    model.set_weights(list(weights))
    path = save(scaled(model), run_dir, bool(cfg.export.saved_model))
    log.info("model saved: %s%s", path, f" and {run_dir / SAVED_MODEL_DIR}" if cfg.export.saved_model else "")
    return path


def save_by_rows(model: Any, weights: list[Any], run_dir: Path) -> Path:
    """`run_dir`/model.keras of `model`, built under serving_rows, with `weights` (the model's
    as built without a store, a table a memory map or an npz.Chunked); see `_save_by_rows`."""
    target = Path(run_dir) / MODEL_FILE
    written(lambda: _save_by_rows(model, weights, target), target)
    return target


def _save_by_rows(model: Any, weights: list[Any], target: Path) -> None:
    """Each ShardedEmbedding saved as a keras Embedding of one marked row, then its input_dim set
    in config.json and its weights written into model.weights.h5 by row pieces
    (tfkv.store.npz.pieces), and the three files zipped under a temporary name: never whole."""
    import h5py
    import keras

    from tfkv.layers import ShardedEmbedding
    from tfkv.store import npz

    tables: list[tuple[Any, int]] = []  # (the placeholder Embedding, the table's rows)

    def clone(layer: Any) -> Any:
        if not isinstance(layer, ShardedEmbedding):
            return _keras_class(type(layer)).from_config(_keras_config(layer))
        placeholder = keras.layers.Embedding.from_config({**layer.keras_config(), "input_dim": 1})
        tables.append((placeholder, layer.input_dim))
        return placeholder

    copy = keras.models.clone_model(model, recursive=True, clone_function=clone)
    if len(copy.weights) != len(weights):
        raise ValueError(f"{len(weights)} weights for a model of {len(copy.weights)} variables")
    where = {id(p.embeddings): j for j, (p, _) in enumerate(tables)}
    marks, values = {}, []
    for v, w in zip(copy.weights, weights):
        j = where.get(id(v))
        if j is None:
            values.append(np.asarray(w))
            continue
        marks[j] = (w, np.full(tuple(v.shape), -1e30 * (j + 1), np.float32))  # found again in the h5 file
        values.append(marks[j][1])
    copy.set_weights(values)
    work = target.parent / f".tmp-export-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    try:
        copy.save(work / MODEL_FILE)
        with zipfile.ZipFile(work / MODEL_FILE) as z:
            config, metadata = json.loads(z.read("config.json")), z.read("metadata.json")
            z.extract("model.weights.h5", work)
        for placeholder, rows in tables:
            _set_input_dim(config, placeholder.name, rows)
        with h5py.File(work / "model.weights.h5", "r+") as f:
            found: list[Any] = []
            f.visititems(lambda name, obj: found.append(obj) if isinstance(obj, h5py.Dataset) else None)
            for j, (table, mark) in marks.items():
                ds = next(d for d in found if d.shape == mark.shape and np.array_equal(d[()], mark))
                parent, name = ds.parent, ds.name.rsplit("/", 1)[1]
                del parent[name]
                out = parent.create_dataset(name, shape=tuple(table.shape), dtype="float32")
                start = 0
                for piece in npz.pieces(table):
                    out[start:start + len(piece)] = piece
                    start += len(piece)
        tmp = work / f"whole-{MODEL_FILE}"
        with zipfile.ZipFile(tmp, "w", allowZip64=True) as z:
            z.writestr("metadata.json", metadata)
            z.writestr("config.json", json.dumps(config))
            z.write(work / "model.weights.h5", "model.weights.h5")
        os.replace(tmp, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _set_input_dim(config: Any, name: str, rows: int) -> None:
    """The Embedding layer `name`'s input_dim, wherever it is in a saved model's config."""
    if isinstance(config, dict):
        if config.get("class_name") == "Embedding" and config.get("config", {}).get("name") == name:
            config["config"]["input_dim"] = rows
        for value in config.values():
            _set_input_dim(value, name, rows)
    elif isinstance(config, list):
        for value in config:
            _set_input_dim(value, name, rows)


def evaluate(cfg: Any, source: Any, parallel: Any, ckpt: Any, run_dir: Path) -> dict[str, Any]:
    """eval_only: the checkpoint's weights (already in `parallel`) on the test split, with the
    training's own evaluation; metrics.json and the model in `run_dir`; returns the metrics."""
    if ckpt is None:  # resume=true found no earlier run of this command (find_resume warned)
        raise ConfigError("eval_only=true: no checkpoint to evaluate; give resume=<run directory or "
                          "checkpoint directory>")
    test = parallel.evaluate_split(source.test)  # alone: the whole split in this process
    metrics = {"epoch": ckpt.epoch, "checkpoint": str(ckpt.path), **{f"test_{k}": float(v) for k, v in test.items()},
               "evaluated_examples": parallel.evaluated[1]}
    write_metrics(run_dir, metrics)
    log.info("eval_only: checkpoint %s (epoch %d) on the test split: %s", ckpt.path, ckpt.epoch,
             "  ".join(f"{k} {v:.4f}" for k, v in metrics.items() if k.startswith("test_")))
    write(cfg, source, ckpt.weights, run_dir)  # the weights evaluated: the checkpoint's, memory-mapped
    return metrics


def written(write: Callable[[], Any], where: Path) -> Any:
    """`write()`'s result; TensorFlow's or the system's failure to write `where` (a full disk) as
    the one-line OutputError, not a traceback from inside TensorFlow."""
    import tensorflow as tf

    try:
        return write()
    except OSError as e:
        reason = e.strerror or str(e)
    except tf.errors.OpError as e:
        # "{{function_node ...}} PATH; No space left on device\n\tFailed to flush ...": the reason
        reason = e.message.splitlines()[0].rsplit("; ", 1)[-1]
    raise OutputError(f"cannot write {where} ({reason}); {unwritable(reason)}")


def write_metrics(run_dir: Path, metrics: dict[str, Any]) -> None:
    """`run_dir`/metrics.json, written under a temporary name and renamed."""
    tmp = run_dir / ".metrics.json.tmp"

    def write() -> None:
        try:
            tmp.write_text(json.dumps(metrics, indent=1))
            tmp.replace(run_dir / "metrics.json")
        finally:
            tmp.unlink(missing_ok=True)

    written(write, run_dir / "metrics.json")
