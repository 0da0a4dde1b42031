"""`hydra/sweeper=tfkv_optuna` (tfkv.sweep.optuna_sweeper): Hydra finds plug-in classes by their
name under `hydra_plugins`, so the sweeper is subclassed here (its name is this module's) and
its config, with the `hydra/sweeper/pruner` group, is registered here."""

from hydra.core.config_store import ConfigStore

from tfkv.sweep import optuna_sweeper


class TfkvOptunaSweeper(optuna_sweeper.TfkvOptunaSweeper):
    """tfkv.sweep.optuna_sweeper.TfkvOptunaSweeper, under the name Hydra instantiates."""


cs = ConfigStore.instance()
cs.store(group="hydra/sweeper", name="tfkv_optuna", node=optuna_sweeper.TfkvOptunaSweeperConf, provider="tfkv")
for name, node in optuna_sweeper.PRUNERS.items():
    cs.store(group="hydra/sweeper/pruner", name=name, node=node, provider="tfkv")
