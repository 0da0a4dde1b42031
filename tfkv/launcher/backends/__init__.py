"""The launcher's backends, one module each (ssh's connection, rsync and remote command beside it;
the batch backends' shared side in batch.py): each module holds its settings dataclass and its
class, which declares its traits, the programs it runs (with their install hints) and its settings
(tfkv.launcher.base.Backend), turns a job into a request by a pure function (`request`: commands
and scripts, tfkv.launcher.request) and runs that request (`launch`). The shared core (plan, job,
record, supervisor, signals) is the package above; it reads the traits, never names."""
