"""The one home of validation: the configuration, checked once at the edge (`tfkv-run`, a
sweep's pre-check), before TensorFlow is imported. What the config alone shows is
tfkv.check.rules'; what needs the layers below is asked here of their registries: known
optimizer, model, data, logger, KVStore and launcher names, the store type's declared
capabilities, gradient compression, the objective, a placement against the model's layer groups,
the settings an option takes. Nothing inside re-rules. One check needs the built model, and so
TensorFlow: `tables`, which tfkv-run calls before a dist_* job's launch where compression is set.

This package belongs to the cli layer: it may import every layer; tfkv.config imports none.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

from tfkv.check import rules
from tfkv.config import objective as objectives
from tfkv.config.cluster import NoCluster
from tfkv.config.schema import ALWAYS_REPORTED, LOGGERS, OPTIMIZER_SCHEMAS, PRECISIONS, Config
from tfkv.errors import ConfigError


def validate(cfg: Any) -> None:
    """Reject what the schema's types cannot: unknown names, keys the chosen option does not have,
    bad devices, a bad workload split, a model or data factory that does not take its settings.
    Each option node (optimizer, cluster) is replaced by its typed form, defaults filled in."""
    from tfkv import checkpoint, models, optim
    from tfkv.data import source

    rules.keys(cfg, Config, "")
    rules.no_missing(cfg)
    optimizer_name = rules.option_name(cfg.optimizer, "optimizer", "name")
    rules.known("optimizer.name", optimizer_name, optim.names(), "optimizer")
    cfg.optimizer = rules.typed(cfg.optimizer, OPTIMIZER_SCHEMAS[optimizer_name], "optimizer", optimizer_name)
    rules.known("optimizer.schedule.name", cfg.optimizer.schedule.name, optim.schedule_names(),
                 "optimizer.schedule.name")
    launcher = rules.option_name(cfg.cluster, "cluster", "launcher")
    cfg.cluster = rules.typed(cfg.cluster, cluster_schema(launcher), "cluster", launcher)
    rules.direction(cfg)
    rules.known("logger", cfg.logger.name, list(LOGGERS), "logger")
    if cfg.logger.name == "mlflow":  # before anything starts, not at worker 0's first epoch
        from tfkv.tracking import mlflow_log

        mlflow_log.check_installed()
    _store_type(cfg.kvstore.type)
    rules.workload(cfg)
    try:  # every rule the optimizer itself holds (momentum, betas, epsilon, ...), the one definition
        optim.from_config(cfg.optimizer, 1, cfg.epochs)
    except ValueError as e:
        raise ConfigError(f"optimizer: {e}; fix it with optimizer.<setting>=...") from None
    _cluster(cfg)
    rules.step_options(cfg, PRECISIONS)
    rules.resume(cfg, checkpoint.NO)
    rules.checkpointing(cfg.checkpoint)
    # Last, what imports the model's, the data's, the loss's modules, which may import TensorFlow:
    # a mistake the config alone shows is refused without it.
    models.check(cfg.model)
    source.check(cfg.dataset)
    _objective(cfg)
    _placement(cfg)


def tables(cfg: Any) -> None:
    """What only the built model shows, checked by tfkv-run before a dist_* job's launch (the
    trainer checks it again for a run in its own process, once its model is built): a
    ShardedEmbedding's table is a row-sparse key, pushed uncompressed, so kvstore.compression
    with one is refused in one line naming the layers, before any role starts. Builds the data's
    description and the model here, on the CPU (this process trains nothing), only where
    compression is set."""
    from tfkv.ps import compression

    comp = cfg.kvstore.compression
    if cfg.eval_only or compression.from_config(comp.type, comp.threshold) is None:
        return
    from tfkv.tfimport import import_tensorflow

    tf = import_tensorflow()
    try:
        tf.config.set_visible_devices([], "GPU")  # no GPU memory held by a process that only launches
    except RuntimeError:  # TensorFlow already started its devices here
        pass
    from tfkv import data, models
    from tfkv.layers import serving_rows
    from tfkv.parallel import sparse

    source = data.Source(cfg.dataset, cfg.seed, cfg.batch_size, cfg.eval_batch_size, 1, 0, cfg.steps_per_epoch)
    with serving_rows():  # as a worker builds it: a ShardedEmbedding's cache of rows, not its table
        model = models.build(cfg.model, input_shape=source.input_shape, input_spec=source.input_spec,
                             num_classes=source.outputs)
    found = sparse.find([model], cfg.kvstore.row_sparse, first_key=0)
    if found:
        raise sparse.compression_refused(found, comp.type)


def cluster_schema(launcher: str) -> type:
    """The settings of `cluster.launcher`: the schema its backend declares (tfkv's or a plug-in's),
    else the common one."""
    from tfkv.launcher.base import REGISTRY as LAUNCHERS, settings

    if launcher == "none":
        return NoCluster
    if launcher in LAUNCHERS:
        return settings(launcher)
    raise ConfigError(f"cluster.launcher={launcher!r} is not known; choose one of "
                      f"{', '.join(sorted({'none', *LAUNCHERS.names()}))} (e.g. cluster=local)")


def option_settings(group: str, node: Any) -> tuple[str, list[str]]:
    """The option a group's node (optimizer, cluster, model, dataset, kvstore) chooses, and the
    settings it takes: its schema's fields, or its factory's keyword arguments."""
    from tfkv import config, models, target

    if group in ("model", "dataset"):
        import inspect

        from tfkv.data import source

        fn = target.locate(node["_target_"], f"{group}._target_")
        provided = models.PROVIDED if group == "model" else source.PROVIDED
        return node["_target_"], [n for n in inspect.signature(fn).parameters if n not in provided]
    schema = {"optimizer": lambda: config.OPTIMIZER_SCHEMAS[node.name],
              "cluster": lambda: cluster_schema(node.launcher),
              "kvstore": lambda: config.KVStoreConfig}[group]()
    return node.get("name") or node.get("launcher") or node.get("type"), [f.name for f in dataclasses.fields(schema)]


def _store_type(kind: str) -> None:
    """A registered type; MXNet's spelling of one, or one of its types tfkv lacks: name ours."""
    from tfkv import store

    if kind not in store.names():
        try:
            use = store.canonical(kind)
        except ValueError as e:
            if str(kind).strip().lower() in store.INSTEAD:
                raise ConfigError(f"kvstore.type={kind!r}: {e}") from None
        else:
            raise ConfigError(f"kvstore.type={kind!r} is MXNet's name for {use}; write kvstore={use}")
    rules.known("kvstore.type", kind, store.names(), "kvstore")


def _objective(cfg: Any) -> None:
    """The loss and metrics build (names known, `_target_`s import), and `objective` is one of the
    values the run will report, so a sweep does not learn it only after the first trial trains.
    A config without one gets the default (tfkv.config.objective), `direction` its way."""
    import difflib

    objective, reported, per_output = _reported(cfg)
    if cfg.get("eval_only") and not objective.startswith("test_"):
        raise ConfigError(f"objective={objective}: eval_only reports only test values; choose one, e.g. "
                          "objective=test_loss")
    if objective not in reported and not per_output(objective):
        close = difflib.get_close_matches(objective, reported, n=1)
        mean = f"did you mean {close[0]}? " if close else ""
        raise ConfigError(f"objective={objective} is not a value this run reports; {mean}it reports "
                          f"{', '.join(reported[:-2])} (and perplexities for language models)")
    cfg.objective = objective
    rules.direction(cfg)
    cfg.direction = objectives.direction(objective, cfg.direction)


def objective_of(cfg: Any) -> tuple[str, str]:
    """The objective a config's run returns and which way it is better, without checking either."""
    objective = _reported(cfg)[0]
    return objective, objectives.direction(objective, cfg.get("direction"))


def _reported(cfg: Any) -> tuple[str, list[str], Callable[[str], bool]]:
    """The config's objective (its default where null), the values the run reports, and whether
    a name is one of a dict-output model's (<phase>_<output>_<metric>, known once the data is)."""
    from tfkv.parallel.criterion import Criterion

    criterion = Criterion.from_config(cfg.loss, cfg.metrics)
    names = criterion.value_names()  # without Keras metric objects, which would start TensorFlow
    reported = [f"{phase}_{n}" for phase in ("train", "test") for n in names] + list(ALWAYS_REPORTED)

    def per_output(objective: str) -> bool:
        return any(objective.startswith(f"{phase}_") and objective.endswith(f"_{n}")
                   for phase in ("train", "test") for n in names)

    named = cfg.get("objective")
    return (str(named) if named is not None else objectives.default(reported)), reported, per_output


def _cluster(cfg: Any) -> None:
    """The store type and the cluster fit each other (the type's declared capabilities), and the
    compression setting parses and is one the type takes."""
    from tfkv import store
    from tfkv.ps import node

    c, kind = cfg.cluster, cfg.kvstore.type
    can = store.capabilities(kind)
    in_job = node.role() is not None
    if can.distributed:
        if c.launcher == "none" and not in_job:
            raise ConfigError(
                f"kvstore={kind} needs a parameter-server cluster: add cluster=local "
                "(cluster.num_workers=2 cluster.num_servers=1), or start the roles yourself with DMLC_ROLE etc.")
        if not can.sync and not cfg.kvstore.update_on_kvstore:
            raise ConfigError(
                f"kvstore={kind} needs the optimizer on the servers (kvstore.update_on_kvstore=true): "
                "without one every push would overwrite the weights")
    elif c.launcher != "none":
        raise ConfigError(f"cluster={c.launcher} starts a parameter-server job, but kvstore={kind} is a "
                          "single-machine store; use kvstore=dist_sync (or dist_async, ...) or drop cluster=")
    if c.get("dry_run") and cfg.eval_only:
        raise ConfigError("cluster.dry_run=true prints the job a launcher would start, but eval_only=true evaluates "
                          "in this process and starts none; drop one of them")
    _compression(cfg, can.compression, can.distributed)
    _row_sharding(cfg)
    _server_threads(cfg)
    rules.cluster_sizes(c)


def _compression(cfg: Any, store_compresses: bool, has_servers: bool) -> None:
    """kvstore.compression names a kind of tfkv.ps.compression.KINDS (by its config name), the
    store type takes compression, and a kind that moves the momentum to the workers has SGD's
    momentum to move and the optimizer in the store to run without it; both_ways (the servers'
    replies compressed too) needs a type and a store with parameter servers."""
    from tfkv.ps import compression

    comp, kind = cfg.kvstore.compression, cfg.kvstore.type
    try:
        setting = compression.from_config(comp.type, comp.threshold, both_ways=comp.both_ways,
                                          pull_threshold=comp.pull_threshold)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if setting is None:
        return
    if setting.both_ways and not has_servers:
        raise ConfigError(f"kvstore.compression.both_ways=true compresses the parameter servers' replies to pulls; "
                          f"kvstore={kind} has no servers: use kvstore=dist_sync (or dist_async, dist_sync_device, "
                          "dist_async_device), or kvstore.compression.both_ways=false")
    if cfg.kvstore.row_sparse:  # what a ShardedEmbedding's model shows is check.tables', once it is built
        raise ConfigError(f"kvstore.compression.type={comp.type} compresses dense gradients, but kvstore.row_sparse="
                          "true makes every Embedding a row-sparse key, whose rows are pushed uncompressed: set "
                          "kvstore.compression.type=none or kvstore.row_sparse=false")
    if not store_compresses:
        raise ConfigError(f"kvstore.compression.type={comp.type} compresses what devices send to be summed "
                          f"(kvstore=device) or workers push to parameter servers (dist_*); kvstore={kind} "
                          "sends neither: use kvstore=device or kvstore=dist_sync")
    exact = next(k.config for k in compression.KINDS if k.quantises and not k.worker_momentum)
    if setting.kind.worker_momentum and cfg.optimizer.name != "sgd":
        raise ConfigError(f"kvstore.compression.type={comp.type} applies SGD's momentum on the workers before "
                          f"quantising; optimizer={cfg.optimizer.name} has none: use optimizer=sgd, or "
                          f"kvstore.compression.type={exact} (MXNet's 2-bit)")
    if setting.kind.worker_momentum and not cfg.kvstore.update_on_kvstore:
        raise ConfigError(f"kvstore.compression.type={comp.type} applies the momentum on the workers and the "
                          "store's optimizer runs without it, but kvstore.update_on_kvstore=false updates on "
                          f"the devices: set kvstore.update_on_kvstore=true, or kvstore.compression.type={exact}")


def timeline(cfg: Any, run_dir: Any) -> None:
    """kvstore.timeline (or the TFKV_TIMELINE that overrides it): the roles of a dist_* job write
    into it, so it must be a directory they can write, made here (a relative one in the run
    directory, recorded absolute for every role), else one line before any role starts."""
    from tfkv import knobs, store
    from tfkv import timeline as recorder

    found = knobs.from_env("kvstore.timeline", os.environ)
    value = found[1] if found else cfg.kvstore.timeline
    if not value:
        return
    if not store.capabilities(cfg.kvstore.type).distributed:
        raise ConfigError(f"kvstore.timeline records the roles of a dist_* job, and kvstore.type={cfg.kvstore.type} "
                          "starts none: use a dist_* type (e.g. kvstore.type=dist_sync) or set kvstore.timeline=null")
    where = recorder.directory(value, None if found else run_dir)  # the variable: as every role reads it
    if not found:
        cfg.kvstore.timeline = str(where)


def _row_sharding(cfg: Any) -> None:
    """kvstore.row_sharding (or the TFKV_ROW_SHARDING that overrides it) is a placement the
    parameter servers know, whatever the store type: a local run of it must not pass a config
    its dist_* run would refuse only once the job has formed."""
    from tfkv.ps import parts

    where, value = _knob_setting(cfg, "kvstore.row_sharding")
    if value not in parts.SHARDINGS:
        raise ConfigError(f"{where}={value!r} is not a row sharding tfkv knows; choose one of "
                          f"{', '.join(parts.SHARDINGS)} (range: each server a block of rows, hash: row r on server "
                          f"r % servers), e.g. kvstore.row_sharding={parts.SHARDINGS[0]}")


def _server_threads(cfg: Any) -> None:
    """kvstore.reduction_nthreads (or the variable that overrides it): 0 (one thread per CPU a
    server may use) or a count of threads, refused here rather than quietly taken as 0 by a server."""
    where, value = _knob_setting(cfg, "kvstore.reduction_nthreads")
    if value < 0:
        raise ConfigError(f"{where}={value} is not a count of threads: set it to 0 (a server uses one thread per CPU "
                          "it may use) or to the threads a server sums and updates a large key with, e.g. "
                          "kvstore.reduction_nthreads=4")


def _knob_setting(cfg: Any, key: str) -> tuple[str, Any]:
    """(where it is set, value) of a knob: its variable where the environment sets it (which wins
    over the config, and is named in a message), else its config key; a variable its type does
    not take is a ConfigError naming it."""
    from tfkv import knobs

    knob = knobs.knob(key)
    found = knobs.from_env(key, os.environ)
    if found:
        return found[0], knobs.parse(knob, found[1], found[0])
    group, setting = key.split(".", 1)
    return key, cfg[group][setting]


def _placement(cfg: Any) -> None:
    """Model parallelism: the model must declare layer groups and the mapping must fit them."""
    from tfkv import models
    from tfkv.parallel import placement

    if not rules.micro_batches(cfg):
        return
    name = models.name(cfg.model)
    if models.layer_groups(cfg.model) is None:
        raise ConfigError(
            f"placement: model {name} declares no layer groups, so it cannot be split over devices; "
            "model parallelism needs a builder with group_names and build_groups (e.g. model=lstm_lm) or placement=null")
    rules.placement_shape(cfg)
    placement.check(cfg.placement, models.group_names(cfg.model), list(cfg.devices), name)
