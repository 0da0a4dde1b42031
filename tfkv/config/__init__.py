"""A run's configuration: the schema (tfkv.config.schema, tfkv.config.cluster) and the checks
the config alone can make (tfkv.config.checks).

tfkv.config is a base module: it imports no other tfkv layer. The checks that need a registry
(known model, data, store and launcher names, a store's capabilities, placement) are made once,
at the edge, by tfkv.check.validate, before TensorFlow is imported. Nothing inside re-checks.
Importing this package is what makes `tfkv_schema` known to Hydra.
"""

from __future__ import annotations

from tfkv.config.checks import parse_device, split_batch
from tfkv.config.cluster import CLUSTER_SCHEMAS, ClusterConfig, NoCluster, RemoteCluster, SSHCluster
from tfkv.config.schema import (ALWAYS_REPORTED, LOGGERS, OPTIMIZER_SCHEMAS, AdamConfig, CheckpointConfig,
                                CompressionConfig, Config,
                                ExportConfig, KVStoreConfig, LoggerConfig, OptimizerConfig, ScheduleConfig,
                                SGDConfig, SweepConfig, register)

register()

__all__ = ["ALWAYS_REPORTED", "CLUSTER_SCHEMAS", "LOGGERS", "OPTIMIZER_SCHEMAS", "AdamConfig", "CheckpointConfig",
           "ClusterConfig",
           "CompressionConfig", "Config", "ExportConfig", "KVStoreConfig", "LoggerConfig", "NoCluster",
           "OptimizerConfig", "RemoteCluster", "SGDConfig", "SSHCluster", "ScheduleConfig", "SweepConfig",
           "parse_device", "register", "split_batch"]
