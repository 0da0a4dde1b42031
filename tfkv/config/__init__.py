"""A run's configuration: the schema (tfkv.config.schema, tfkv.config.cluster: every launcher's
settings, each backend's own in its module under tfkv.launcher.backends; the backend
knobs' fields derived from tfkv.knobs), the config tree and its composition (tfkv.config.tree),
device specs (tfkv.config.device_specs) and which value a run returns (tfkv.config.objective).

tfkv.config is a base module: it imports no other tfkv layer. The config is validated once, at
the edge, by tfkv.check.validate, before TensorFlow is imported. Nothing inside re-checks.
Importing this package is what makes `tfkv_schema` known to Hydra.
"""

from __future__ import annotations

from tfkv.config.device_specs import parse_device, split_batch
from tfkv.config.cluster import ClusterConfig, NoCluster, RemoteCluster
from tfkv.config.schema import (ALWAYS_REPORTED, LOGGERS, OPTIMIZER_SCHEMAS, AdamConfig, CheckpointConfig,
                                CompressionConfig, Config,
                                ExportConfig, KVStoreConfig, LoggerConfig, OptimizerConfig, ScheduleConfig,
                                SGDConfig, SweepConfig, register)

register()

__all__ = ["ALWAYS_REPORTED", "LOGGERS", "OPTIMIZER_SCHEMAS", "AdamConfig", "CheckpointConfig",
           "ClusterConfig",
           "CompressionConfig", "Config", "ExportConfig", "KVStoreConfig", "LoggerConfig", "NoCluster",
           "OptimizerConfig", "RemoteCluster", "SGDConfig", "ScheduleConfig", "SweepConfig",
           "parse_device", "register", "split_batch"]
