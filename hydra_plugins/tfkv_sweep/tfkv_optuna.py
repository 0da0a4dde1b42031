"""`hydra/sweeper=tfkv_optuna` (tfkv.sweep.optuna_sweeper): Hydra finds plug-in classes by their
name under `hydra_plugins`, so the sweeper is subclassed here (its name is this module's) and
its config, with the `hydra/sweeper/pruner` group, is registered here. Without Hydra's Optuna
sweeper (pip install 'tfkv[sweep]') there is nothing to register: Hydra scans this module at
every start and would warn about an ImportError each time; tfkv-run names the package instead."""

from hydra.core.config_store import ConfigStore

try:
    from tfkv.sweep import optuna_sweeper
except ModuleNotFoundError as e:
    if not (e.name or "").startswith("hydra_plugins.hydra_optuna_sweeper"):
        raise
    optuna_sweeper = None

if optuna_sweeper is not None:

    class TfkvOptunaSweeper(optuna_sweeper.TfkvOptunaSweeper):
        """tfkv.sweep.optuna_sweeper.TfkvOptunaSweeper, under the name Hydra instantiates."""

    cs = ConfigStore.instance()
    cs.store(group="hydra/sweeper", name="tfkv_optuna", node=optuna_sweeper.TfkvOptunaSweeperConf, provider="tfkv")
    for name, node in optuna_sweeper.PRUNERS.items():
        cs.store(group="hydra/sweeper/pruner", name=name, node=node, provider="tfkv")
