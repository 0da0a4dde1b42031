"""A role's ClusterEnv: its knob attributes derived from the rows of tfkv.knobs (one definition
of each knob), and the one place that reads the role and dispatches (tfkv.ps.node)."""

from __future__ import annotations

import dataclasses
import inspect
import re

import pytest

from tfkv import knobs
from tfkv.ps import cluster_env, node
from tfkv.ps.cluster_env import ClusterEnv, ClusterEnvError

WIRING = {"DMLC_ROLE": "server", "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "9", "DMLC_NUM_SERVER": "1",
          "DMLC_NUM_WORKER": "2", "TFKV_SECURE": "0"}
# What the parameter server's modules read of a role's ClusterEnv: the names stay.
READ = {"interface", "bigarray_bound", "verbose", "resend", "resend_timeout", "heartbeat_interval", "heartbeat_timeout",
        "request_timeout", "start_timeout", "max_message_bytes", "reduction_nthreads", "chunk_bytes", "fusion_bytes",
        "row_sharding", "timeline"}


def test_every_runtime_knob_is_one_attribute_from_its_row():
    defaults = {f.name: f.default for f in dataclasses.fields(ClusterEnv)}
    rows = knobs.read_by(knobs.PS)
    assert {k.setting for k in rows} == READ
    for k in rows:
        assert defaults[k.setting] == (None if k.default is None else k.in_cluster_env(k.default)), k.key
    assert (defaults["resend_timeout"], defaults["fusion_bytes"], defaults["heartbeat_timeout"]) == (1.0, 512 << 10, 4.0)
    source = inspect.getsource(cluster_env)  # no default declared again, no line per knob
    assert not [k.setting for k in rows if re.search(rf"^\s+{k.setting}\s*:|\b{k.setting}=", source, re.M)]


def test_a_role_reads_each_knob_from_its_variables():
    env = ClusterEnv.from_env({**WIRING, "TFKV_FUSION_BYTES": "0", "PS_RESEND_TIMEOUT": "250", "PS_RESEND": "1",
                               "MXNET_KVSTORE_REDUCTION_NTHREADS": "-3", "TFKV_CHUNK_BYTES": "2",
                               "TFKV_HEARTBEAT_TIMEOUT": "9", "DMLC_INTERFACE": "lo", "PS_VERBOSE": "2"})
    assert (env.role, env.num_workers, env.fusion_bytes, env.resend, env.resend_timeout, env.reduction_nthreads,
            env.chunk_bytes, env.heartbeat_timeout, env.interface, env.verbose) == (
        "server", 2, 0, True, 0.25, 0, 4, 9.0, "lo", 2)  # milliseconds -> seconds; the least taken
    plain = ClusterEnv.from_env(WIRING)
    assert (plain.bigarray_bound, plain.request_timeout, plain.interface) == (1_000_000, 60.0, None)
    with pytest.raises(ClusterEnvError, match="TFKV_CHUNK_BYTES='big' is not an int"):
        ClusterEnv.from_env({**WIRING, "TFKV_CHUNK_BYTES": "big"})
    # positional wiring, keyword knobs: as the server's tests build one
    assert ClusterEnv("server", "127.0.0.1", 1, 1, 3, bigarray_bound=5).bigarray_bound == 5


def test_no_module_but_cluster_env_reads_a_process_s_role():
    """DMLC_ROLE/TFKV_ROLE are read in tfkv/ps/cluster_env.py (ClusterEnv.role_of, asked by
    tfkv.ps.node.role) alone; the cli, the checks and the launcher's worker overrides ask node.role
    or are given its answer. (tfkv/launcher/role.py reads the role in the plan of a process it is
    about to start, not its own.)"""
    import ast
    from pathlib import Path

    import tfkv

    names = {"DMLC_ROLE", "TFKV_ROLE"}

    def reads(node):
        if isinstance(node, ast.Call):
            return any(isinstance(a, ast.Constant) and a.value in names for a in node.args)
        return (isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load)
                and isinstance(node.slice, ast.Constant) and node.slice.value in names)

    root = Path(tfkv.__file__).parent
    found = {str(f.relative_to(root)) for f in root.rglob("*.py") if any(map(reads, ast.walk(ast.parse(f.read_text()))))}
    assert found == {"ps/cluster_env.py", "launcher/role.py"}


def test_one_place_reads_the_role_and_dispatches(monkeypatch):
    assert (node.role({"DMLC_ROLE": "Server"}), node.role({}), node.role({"TFKV_ROLE": "worker", "DMLC_ROLE": "x"})) == (
        "server", None, "worker")
    ran = []
    monkeypatch.setattr(node, "run_role", lambda env: ran.append(env.role) or 7)
    assert node.run_unless_worker(ClusterEnv("worker", "h", 1, 1, 1)) is None and not ran  # a worker trains
    for role in ("scheduler", "server"):
        with pytest.raises(SystemExit) as ended:
            node.run_unless_worker(ClusterEnv(role, "h", 1, 1, 1))
        assert ended.value.code == 7
    assert ran == ["scheduler", "server"]
    monkeypatch.setenv("DMLC_ROLE", "worker")
    assert node.main(workers_return=True) is None  # tfkv-run's first step: a worker goes on to train
    monkeypatch.delenv("DMLC_ROLE")
    assert node.main(workers_return=True) is None  # and so does a process outside a job
