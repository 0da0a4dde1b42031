"""Backend knobs: every environment variable that tunes tfkv's runtime or its launchers, once.

Each knob has one row below: the variables read (tfkv's own name first where it has one, the
name MXNet/ps-lite users know last: that one is handed on and named in messages), its config key
(`kvstore.*` or `cluster.*`, a field of the structured config whose default and help come from
this row), its type, default and one line of doc. The environment wins over the config: a
variable set in the launching shell overrides the key. `tfkv-run` and `tfkv-launch` record the
effective values in the run directory (`knobs.json`) and hand the role knobs to every role's
environment, so the runtime reads one place, `knobs.get(NAME)`, whether a launcher or a user
started the process. Process wiring (DMLC_ROLE, the scheduler's address, the job's keys, the run
directory) is not a knob. Imports nothing of tfkv but errors.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from tfkv.errors import ConfigError


@dataclass(frozen=True)
class Knob:
    names: tuple[str, ...]  # the variables read, in this order; the last is handed on and named
    key: str  # the config key, e.g. kvstore.chunk_bytes
    type: type
    default: Any
    doc: str
    role: bool = True  # read by the roles (handed to each); False: by the launcher that starts them

    @property
    def env(self) -> str:
        return self.names[-1]

    @property
    def setting(self) -> str:
        return self.key.split(".", 1)[1]


KNOBS: tuple[Knob, ...] = (
    Knob(("TFKV_BIGARRAY_BOUND", "MXNET_KVSTORE_BIGARRAY_BOUND"), "kvstore.bigarray_bound", int, 1_000_000,
         "arrays of more elements are split across all servers; smaller keys go to one server"),
    Knob(("TFKV_REDUCTION_NTHREADS", "MXNET_KVSTORE_REDUCTION_NTHREADS"), "kvstore.reduction_nthreads", int, 4,
         "threads a server sums arrays of at least the big-array bound with"),
    Knob(("PS_RESEND",), "kvstore.resend", bool, False,
         "retransmit a request not answered within resend_timeout; servers never apply one twice"),
    Knob(("PS_RESEND_TIMEOUT",), "kvstore.resend_timeout", float, 1000.0,
         "milliseconds before an unanswered request is resent (with resend)"),
    Knob(("TFKV_CHUNK_BYTES",), "kvstore.chunk_bytes", int, 16 << 20,
         "the largest message a worker sends for one key (a larger part is cut into chunks)"),
    Knob(("TFKV_FUSION_BYTES",), "kvstore.fusion_bytes", int, 512 << 10,
         "requests (and replies) to one server are held and sent together until this many payload "
         "bytes are queued or the node waits; 0 sends each at once"),
    Knob(("TFKV_MAX_MESSAGE_BYTES",), "kvstore.max_message_bytes", int, 1 << 31,
         "the largest payload a server accepts (a larger one is refused with an error)"),
    Knob(("TFKV_ENABLE_GPU_P2P", "MXNET_ENABLE_GPU_P2P"), "kvstore.gpu_p2p", bool, True,
         "device types: sum a key's device values on a device (false: through host memory)"),
    Knob(("PS_VERBOSE",), "cluster.verbose", int, 0, "PS_VERBOSE: 1 connections, 2 every message"),
    Knob(("DMLC_INTERFACE",), "cluster.interface", str, None,
         "network interface the servers listen on (DMLC_INTERFACE)"),
    Knob(("TFKV_HEARTBEAT_TIMEOUT",), "cluster.heartbeat_timeout", float, 4.0,
         "seconds of silence before a node counts as failed"),
    Knob(("TFKV_HEARTBEAT_INTERVAL",), "cluster.heartbeat_interval", float, 0.5, "seconds between heartbeats"),
    Knob(("TFKV_REQUEST_TIMEOUT",), "cluster.request_timeout", float, 60.0,
         "seconds a live server may leave a request and a question about it unanswered before the job fails"),
    Knob(("TFKV_START_TIMEOUT",), "cluster.start_timeout", float, 120.0,
         "seconds the scheduler waits for every node to register"),
    Knob(("TFKV_SSH_CONFIG",), "cluster.ssh_config", str, None,
         "ssh: this ssh config file instead of ~/.ssh/config", role=False),
    Knob(("TFKV_MPIRUN_ARGS",), "cluster.mpirun_args", str, "", "mpi: more mpirun flags", role=False),
    Knob(("TFKV_SRUN_ARGS",), "cluster.srun_args", str, "", "slurm: more srun flags (e.g. \"-p gpu\")",
         role=False),
    Knob(("TFKV_SBATCH_ARGS",), "cluster.sbatch_args", str, "", "slurm: more sbatch flags (e.g. \"--time 1:00:00\")",
         role=False),
    Knob(("TFKV_QSUB_ARGS",), "cluster.qsub_args", str, "", "sge: more qsub flags (e.g. \"-q all.q\")", role=False),
    Knob(("TFKV_YARN_MEMORY_MB",), "cluster.yarn_memory_mb", int, 2048, "yarn: MB per worker container", role=False),
    Knob(("TFKV_YARN_SERVER_MEMORY_MB",), "cluster.yarn_server_memory_mb", int, 1024,
         "yarn: MB per server (and scheduler) container", role=False),
    Knob(("TFKV_YARN_VCORES",), "cluster.yarn_vcores", int, 1, "yarn: virtual cores per container", role=False),
    Knob(("TFKV_YARN_QUEUE",), "cluster.yarn_queue", str, None, "yarn: the queue (default: YARN's)", role=False),
)
BY_NAME = {n: k for k in KNOBS for n in k.names}
BY_KEY = {k.key: k for k in KNOBS}
FILE = "knobs.json"  # in the run directory: the effective values

# The launching process's values from its config (tfkv-run) or flags (tfkv-launch); the
# environment still wins. Set once per job by `configure`.
_configured: dict[str, Any] = {}


class KnobError(ConfigError, ValueError):
    """A knob's variable holds what its type does not take: one line naming the variable (a
    ValueError too, which the roles' environment check turns into its own one line)."""


def knob(name: str) -> Knob:
    """The row of a variable name or a config key."""
    return BY_NAME.get(name) or BY_KEY[name]


def parse(k: Knob, text: str, name: str | None = None) -> Any:
    """A variable's text as the knob's type; KnobError `NAME='x' is not a int; ...` otherwise."""
    if k.type is bool:
        return text.strip().lower() not in ("0", "false", "no", "off", "")
    if k.type is str:
        return text
    try:
        return k.type(text)
    except (TypeError, ValueError):
        raise KnobError(f"{name or k.env}={text!r} is not a {k.type.__name__}; set it to one or unset it "
                        f"({k.key} in the config)") from None


def from_env(name: str, env: Mapping[str, str]) -> tuple[str, str] | None:
    """(variable, text) of the first of the knob's variables set non-empty in `env`."""
    for n in knob(name).names:
        if env.get(n):
            return n, env[n]
    return None


def get(name: str, env: Mapping[str, str] | None = None) -> Any:
    """The knob's value: the environment's (os.environ unless given), else the configured, else
    its default. `name` is any of its variables or its config key."""
    import os

    k = knob(name)
    found = from_env(name, os.environ if env is None else env)
    if found is not None:
        return parse(k, found[1], found[0])  # the message names the variable the user set
    return _configured.get(k.key, k.default)


def resolve(settings: Mapping[str, Any], env: Mapping[str, str]) -> dict[str, Any]:
    """Every knob's effective value, by config key: the environment's, else `settings` (config
    key -> value, e.g. from the config's kvstore and cluster nodes), else the default."""
    out = {}
    for k in KNOBS:
        found = from_env(k.key, env)
        out[k.key] = parse(k, found[1], found[0]) if found else settings.get(k.key, k.default)
    return out


def settings(cfg: Any) -> dict[str, Any]:
    """The knobs a config node tree sets: {"kvstore.resend": ..., "cluster.verbose": ...}."""
    out = {}
    for k in KNOBS:
        group, setting = k.key.split(".", 1)
        node = cfg.get(group) if hasattr(cfg, "get") else getattr(cfg, group, None)
        if node is not None and setting in node:
            out[k.key] = node[setting]
    return out


def configure(values: Mapping[str, Any]) -> None:
    """This process's values (from `resolve`), for the launcher-side readers of `get`."""
    _configured.clear()
    _configured.update(values)


def environment(values: Mapping[str, Any]) -> dict[str, str]:
    """The role knobs as variables for every role's environment (unset ones left out)."""
    out = {}
    for k in KNOBS:
        value = values.get(k.key, k.default)
        if k.role and value is not None:
            out[k.env] = ("1" if value else "0") if k.type is bool else str(value)
    return out


def record(run_dir: Path, values: Mapping[str, Any]) -> Path:
    """knobs.json in the run directory: each knob's config key, variable and effective value."""
    path = Path(run_dir) / FILE
    path.write_text(json.dumps({k.key: {"env": k.env, "value": values.get(k.key, k.default)} for k in KNOBS},
                               indent=1) + "\n")
    return path
