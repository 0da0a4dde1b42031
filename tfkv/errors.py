"""Errors a user can act on: their message is one line saying what is wrong and how to fix it.

`tfkv-run` prints these as a single line and exits non-zero; anything else is a bug and keeps
its traceback.
"""


# Exit status of a process that stopped because another node of its job failed: launchers
# blame the first process that did not exit with it.
EXIT_PEER_FAILED = 3


class TfkvError(Exception):
    """Base of every user-facing error."""


class ConfigError(TfkvError):
    """The configuration is wrong (unknown name, bad device, impossible split...)."""


class DataError(TfkvError):
    """A data set is missing or malformed on disk."""


class OutputError(TfkvError):
    """The run directory cannot be written (a full disk, a read-only file system); the message
    names the file and the system's reason."""


class ClusterFailed(TfkvError):
    """A role of a distributed job failed; the message names it."""


class TrialPruned(TfkvError):
    """A sweep's pruner stopped this trial early (worse than its peers at the same epoch): a
    result of the sweep, not a failure."""
