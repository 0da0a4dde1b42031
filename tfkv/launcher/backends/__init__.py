"""The launcher's backends, one module each (ssh's connection, rsync and remote command beside it;
the batch backends' shared side in batch.py): each a class that declares its traits and its
settings (tfkv.launcher.base.Backend) and starts the planned processes its way. The shared core
(plan, job, record, supervisor, signals) is the package above; it reads the traits, never names."""
