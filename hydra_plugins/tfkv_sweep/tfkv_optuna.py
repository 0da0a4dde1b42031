"""`hydra/sweeper=tfkv_optuna` (tfkv.sweep.optuna_sweeper): Hydra finds plug-in classes by their
name under `hydra_plugins`, so the sweeper is subclassed here (its name is this module's) and
its config, with the `hydra/sweeper/sampler` and `hydra/sweeper/pruner` groups, is registered
here. Registering imports no Optuna: a sweep that uses it without Optuna installed is one line
naming the package (tfkv.sweep.pruning.check_optuna)."""

from hydra.core.config_store import ConfigStore

from tfkv.sweep import optuna_sweeper


class TfkvOptunaSweeper(optuna_sweeper.TfkvOptunaSweeper):
    """tfkv.sweep.optuna_sweeper.TfkvOptunaSweeper, under the name Hydra instantiates."""


cs = ConfigStore.instance()
cs.store(group="hydra/sweeper", name="tfkv_optuna", node=optuna_sweeper.TfkvOptunaSweeperConf, provider="tfkv")
for group, nodes in (("sampler", optuna_sweeper.SAMPLERS), ("pruner", optuna_sweeper.PRUNERS)):
    for name, node in nodes.items():
        cs.store(group=f"hydra/sweeper/{group}", name=name, node=node, provider="tfkv")
