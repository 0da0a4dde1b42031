"""`hydra/launcher=tfkv`: tfkv.sweep.launcher's launcher where Hydra looks for it, and its config
registered (group hydra/launcher, name tfkv, provider tfkv).

Hydra instantiates a launcher only from a class defined in a `hydra_plugins.*` module (it looks the
class up by `__module__.__name__`), so the class is defined here, as a subclass adding nothing."""

from hydra.core.config_store import ConfigStore

from tfkv.sweep import launcher
from tfkv.sweep.launcher import TfkvLauncherConf

__all__ = ["TfkvLauncher", "TfkvLauncherConf"]


class TfkvLauncher(launcher.TfkvLauncher):
    """Whole distributed trials side by side on disjoint hosts: see tfkv.sweep.launcher."""


ConfigStore.instance().store(group="hydra/launcher", name="tfkv", node=TfkvLauncherConf, provider="tfkv")
