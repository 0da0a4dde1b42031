"""`schema/cluster/<name>`: tfkv's launchers' settings registered in Hydra's ConfigStore when Hydra
scans its plug-ins, as a Hydra launcher plug-in registers its config, before any config is composed
(tfkv-run, Hydra's compose API, tfkv.config.tree). Each backend declares its settings in its own
module (tfkv.launcher.backends.*), which the config layer below it may not import; this shim, at the
entry layer, reads them through the launcher registry (tfkv.plugins.register_schemas)."""

from tfkv.plugins import register_schemas

register_schemas()
