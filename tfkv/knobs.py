"""Backend knobs: every environment variable that tunes tfkv's runtime or its launchers, once.

Each knob has one row below: the variables read (tfkv's own name first where it has one, the
name MXNet/ps-lite users know last: that one is handed on and named in messages), its config key
(`kvstore.*` or `cluster.*`, a field of the structured config whose default and help come from
this row), its type, default, one line of doc, and who reads it. The row is the knob's one
definition: the config schema's field, `ClusterEnv`'s attribute (tfkv.ps.cluster_env) and the
record are derived from it. The environment wins over the config: a variable set in the
launching shell overrides the key.

One route: the process that starts a job resolves the knobs once (`resolve`), records them in
the run directory (`record`, knobs.json) and hands the role knobs to every role's environment
(`environment`, the child processes' only). A process that trains resolves them once too (its
config and its environment) and passes the values down to its store and the store's ClusterEnv
(`value`: the passed value); what is given no values, e.g. an MXNet-style script that sets the
variables itself, reads its environment (`get`). Process wiring (DMLC_ROLE, the scheduler's
address, the job's keys, the run directory) is not a knob. Imports nothing of tfkv but errors.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection, Mapping, Optional

from tfkv.errors import ConfigError, with_article


# Who reads a knob: the parameter-server runtime of every role (an attribute of its ClusterEnv),
# the stores that sum device values (a worker's), or the launcher that starts the roles.
PS, STORE, LAUNCHER = "ps", "store", "launcher"


@dataclass(frozen=True)
class Knob:
    names: tuple[str, ...]  # the variables read, in this order; the last is handed on and named
    key: str  # the config key, e.g. kvstore.chunk_bytes
    type: type
    default: Any
    doc: str
    reader: str = PS  # PS, STORE (both handed to every role) or LAUNCHER (kept by the launcher)
    least: int | None = None  # ClusterEnv raises a smaller value to this
    unit: float = 1  # ClusterEnv's attribute is the value / unit (resend_timeout: ms -> seconds)

    @property
    def env(self) -> str:
        return self.names[-1]

    @property
    def setting(self) -> str:
        """The field's name in the config node (and ClusterEnv's attribute)."""
        return self.key.split(".", 1)[1]

    @property
    def role(self) -> bool:
        """Read by the roles, so handed to each role's environment."""
        return self.reader != LAUNCHER

    @property
    def help(self) -> str:
        """The config field's one-line help, naming the variable that overrides it."""
        return self.doc if self.env in self.doc else f"{self.doc} ({self.env})"

    def in_cluster_env(self, value: Any) -> Any:
        """The value as ClusterEnv holds it: raised to `least`, in ClusterEnv's unit."""
        if self.least is not None:
            value = max(self.least, value)
        return value / self.unit if self.unit != 1 else value


KNOBS: tuple[Knob, ...] = (
    Knob(("TFKV_BIGARRAY_BOUND", "MXNET_KVSTORE_BIGARRAY_BOUND"), "kvstore.bigarray_bound", int, 1_000_000,
         "arrays of more elements are split across all servers; smaller keys go to one server"),
    Knob(("TFKV_REDUCTION_NTHREADS", "MXNET_KVSTORE_REDUCTION_NTHREADS"), "kvstore.reduction_nthreads", int, 0,
         "threads a server sums and updates a large key with (each takes a range of at least 64K values); "
         "0: one per CPU the server may use (its affinity and cgroup CPU quota)", least=0),
    Knob(("PS_RESEND",), "kvstore.resend", bool, False,
         "retransmit a request not answered within resend_timeout; servers never apply one twice"),
    Knob(("PS_RESEND_TIMEOUT",), "kvstore.resend_timeout", float, 1000.0,
         "milliseconds before an unanswered request is resent (with resend)", unit=1000),
    Knob(("TFKV_CHUNK_BYTES",), "kvstore.chunk_bytes", int, 16 << 20,
         "the largest message a worker sends for one key (a larger part is cut into chunks)", least=4),
    Knob(("TFKV_ROW_SHARDING",), "kvstore.row_sharding", str, "range",
         "row-sparse keys: how a table's rows are spread over the servers: range (server s holds rows "
         "[s*N/S, (s+1)*N/S)) or hash (row r on server r % S)"),
    Knob(("TFKV_FUSION_BYTES",), "kvstore.fusion_bytes", int, 512 << 10,
         "requests (and replies) to one server are held and sent together until this many payload "
         "bytes are queued or the node waits; 0 sends each at once", least=0),
    Knob(("TFKV_MAX_MESSAGE_BYTES",), "kvstore.max_message_bytes", int, 1 << 31,
         "the largest payload a server accepts (a larger one is refused with an error)"),
    Knob(("TFKV_ENABLE_GPU_P2P", "MXNET_ENABLE_GPU_P2P"), "kvstore.gpu_p2p", bool, True,
         "device types: sum a key's device values on a device (false: through host memory)", reader=STORE),
    Knob(("TFKV_TIMELINE",), "kvstore.timeline", str, None,
         "a directory where each role of a dist_* job writes its Chrome-trace/Perfetto timeline (worker-0.json, "
         "server-0.json; merged by python -m tfkv.timeline merge DIR); relative: in the run directory; null: off"),
    Knob(("PS_VERBOSE",), "cluster.verbose", int, 0, "PS_VERBOSE: 1 connections, 2 every message"),
    Knob(("DMLC_INTERFACE",), "cluster.interface", str, None,
         "network interface the servers listen on (DMLC_INTERFACE)"),
    Knob(("TFKV_HEARTBEAT_TIMEOUT",), "cluster.heartbeat_timeout", float, 4.0,
         "seconds of silence before a node counts as failed"),
    Knob(("TFKV_HEARTBEAT_INTERVAL",), "cluster.heartbeat_interval", float, 0.5, "seconds between heartbeats"),
    # a dist_sync pull may wait longer than request_timeout: the server answers a PING that it holds it
    Knob(("TFKV_REQUEST_TIMEOUT",), "cluster.request_timeout", float, 60.0,
         "seconds a live server may leave a request and a question about it unanswered before the job fails"),
    Knob(("TFKV_START_TIMEOUT",), "cluster.start_timeout", float, 120.0,
         "seconds the scheduler waits for every node to register"),
    Knob(("TFKV_SSH_CONFIG",), "cluster.ssh_config", str, None,
         "ssh: this ssh config file instead of ~/.ssh/config", reader=LAUNCHER),
    Knob(("TFKV_MPIRUN_ARGS",), "cluster.mpirun_args", str, "", "mpi: more mpirun flags", reader=LAUNCHER),
    Knob(("TFKV_SRUN_ARGS",), "cluster.srun_args", str, "", "slurm: more srun flags (e.g. \"-p gpu\")",
         reader=LAUNCHER),
    Knob(("TFKV_SBATCH_ARGS",), "cluster.sbatch_args", str, "", "slurm: more sbatch flags (e.g. \"--time 1:00:00\")",
         reader=LAUNCHER),
    Knob(("TFKV_QSUB_ARGS",), "cluster.qsub_args", str, "", "sge: more qsub flags (e.g. \"-q all.q\")", reader=LAUNCHER),
    Knob(("TFKV_YARN_MEMORY_MB",), "cluster.yarn_memory_mb", int, 2048, "yarn: MB per worker container", reader=LAUNCHER),
    Knob(("TFKV_YARN_SERVER_MEMORY_MB",), "cluster.yarn_server_memory_mb", int, 1024,
         "yarn: MB per server (and scheduler) container", reader=LAUNCHER),
    Knob(("TFKV_YARN_VCORES",), "cluster.yarn_vcores", int, 1, "yarn: virtual cores per container", reader=LAUNCHER),
    Knob(("TFKV_YARN_QUEUE",), "cluster.yarn_queue", str, None, "yarn: the queue (default: YARN's)", reader=LAUNCHER),
)
BY_NAME = {n: k for k in KNOBS for n in k.names}
BY_KEY = {k.key: k for k in KNOBS}
FILE = "knobs.json"  # in the run directory: the effective values


class KnobError(ConfigError, ValueError):
    """A knob's variable holds what its type does not take: one line naming the variable (a
    ValueError too, which the roles' environment check turns into its own one line)."""


def knob(name: str) -> Knob:
    """The row of a variable name or a config key."""
    return BY_NAME.get(name) or BY_KEY[name]


def parse(k: Knob, text: str, name: str | None = None) -> Any:
    """A variable's text as the knob's type; KnobError `NAME='x' is not an int; ...` otherwise."""
    if k.type is bool:
        return text.strip().lower() not in ("0", "false", "no", "off", "")
    if k.type is str:
        return text
    try:
        return k.type(text)
    except (TypeError, ValueError):
        raise KnobError(f"{name or k.env}={text!r} is not {with_article(k.type.__name__)}; set it to one or unset it "
                        f"({k.key} in the config)") from None


def from_env(name: str, env: Mapping[str, str]) -> tuple[str, str] | None:
    """(variable, text) of the first of the knob's variables set non-empty in `env`."""
    for n in knob(name).names:
        if env.get(n):
            return n, env[n]
    return None


def read_by(reader: str) -> tuple[Knob, ...]:
    """The rows of the knobs `reader` (PS, STORE, LAUNCHER) reads, in table order."""
    return tuple(k for k in KNOBS if k.reader == reader)


def get(name: str, env: Mapping[str, str] | None = None) -> Any:
    """The knob's value in a role's environment (os.environ unless given), else its default.
    `name` is any of its variables or its config key."""
    k = knob(name)
    found = from_env(name, os.environ if env is None else env)
    if found is not None:
        return parse(k, found[1], found[0])  # the message names the variable the user set
    return k.default


def value(name: str, values: Mapping[str, Any] | None, env: Mapping[str, str] | None = None) -> Any:
    """The knob's value in `values` (resolved, by config key: `resolve`), its default where they
    lack it; without values (None), the environment's (`get`), as a process started by hand reads it."""
    if values is None:
        return get(name, env)
    k = knob(name)
    return values.get(k.key, k.default)


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


def fields(group: str, readers: Collection[str] = (PS, STORE, LAUNCHER)) -> list[tuple[str, Any, Any]]:
    """The config schema's fields of the knobs of `group` ("kvstore") that `readers` read, for
    `dataclasses.make_dataclass`: name, type, and a field with the row's default and help."""
    return [(k.setting, Optional[k.type] if k.default is None else k.type,
             dataclasses.field(default=k.default, metadata={"help": k.help, "short": None}))
            for k in KNOBS if k.key.startswith(f"{group}.") and k.reader in readers]


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
