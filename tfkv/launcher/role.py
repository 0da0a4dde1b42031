"""One role of a job started by a resource manager: `python -m tfkv.launcher.role [options] -- [argv]`.

mpirun, srun and qsub start N copies of one command and tell each copy its rank
(OMPI_COMM_WORLD_RANK, SLURM_PROCID, SGE_TASK_ID). This helper turns that rank into a role of
the plan: it sets DMLC_ROLE, TFKV_RANK_HINT and the rest of the process's environment, starts
the role's command (`python -m tfkv.ps.node` or the worker's command) and prefixes every line
of its output with the role's name, so the job's output reads as `tfkv-launch --launcher local`'s.
When the role ends it prints one line, `[worker 1] tfkv-role: worker 1 exited with status 1`,
from which the launcher learns which role failed first.

A worker's local rank (TFKV_LOCAL_RANK, TFKV_LOCAL_SIZE: its index among the workers on its node)
comes with the plan where the plan placed it (mpi). Under srun, which picks the nodes, the helper
works it out from SLURM_PROCID, SLURM_LOCALID and SLURM_STEP_TASKS_PER_NODE: srun's default
(block) distribution gives each node consecutive ranks, and the workers are the plan's last ranks.

Two ways to say which command each rank runs:

    --plan JSON      what the launchers pass: {"env": {...}, "first": R, "procs": [{"name", "argv",
                     "env"}, ...]}, the processes for ranks R, R+1, ... with their exact commands
    -- ARGV          by hand, e.g. in your own sbatch script: rank 0 is the scheduler, the next
                     DMLC_NUM_SERVER ranks servers, the rest workers running ARGV ("{rank}" in
                     ARGV becomes the worker's index)

Teardown: the role's command runs in its own process group and dies with this helper
(PR_SET_PDEATHSIG); SIGTERM, SIGINT and SIGHUP are passed on to the whole group (a role takes
SIGTERM as a preemption, tfkv.preempt; under Slurm it gets it twice, directly and from here,
and the second changes nothing). This helper itself gets SIGHUP when whatever started it
(orted, slurmstepd, sge_shepherd) dies, so no role outlives the job even when the resource
manager only kills its direct child.

The launchers build the helper's input with `table`/`helper_argv`; what they share beyond that
is in tfkv.launcher.backends.batch (the merged output that notes each role's end) and
tfkv.launcher.process (process groups, exit status).
No TensorFlow is imported here.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
from typing import Any, Sequence

from tfkv.config.device_specs import LOCAL_RANK, LOCAL_SIZE
from tfkv.errors import TfkvError
from tfkv.launcher.plan import Process, make_plan
from tfkv.launcher.process import die_with_parent, signal_group, status_text

# Rank variables in the order they are looked for, with the number of their first rank.
RANK_VARS = (("OMPI_COMM_WORLD_RANK", 0), ("PMIX_RANK", 0), ("PMI_RANK", 0), ("SLURM_PROCID", 0),
             ("SGE_TASK_ID", 1))

# The line run_role prints when its role ends (exit_line); batch.Output parses it.
EXIT_LINE = re.compile(r"^\[(?P<name>[^\]]+)\] tfkv-role: (?P=name) "
                   r"(?:exited with status (?P<code>-?\d+)|was killed by (?P<sig>SIG[A-Z0-9]+))$")


# -- the plan as a table the helper reads ---------------------------------------------------------

def common_env(plan: Sequence[Process]) -> dict[str, str]:
    """The variables every process of the plan has with the same value (DMLC_PS_ROOT_URI, ...)."""
    if not plan:
        return {}
    return {k: v for k, v in plan[0].env.items() if all(p.env.get(k) == v for p in plan)}


def table(plan: Sequence[Process], first: int = 0) -> dict[str, Any]:
    """The processes for ranks first, first+1, ... as the helper's --plan: the environment they
    share once, then each one's name, command and own variables (DMLC_ROLE, TFKV_RANK_HINT)."""
    common = common_env(plan)
    return {"env": common, "first": first,
            "procs": [{"name": p.name, "argv": list(p.argv),
                       "env": {k: v for k, v in p.env.items() if common.get(k) != v}} for p in plan]}


def helper_argv(python: str, plan: Sequence[Process], first: int = 0, rank_var: str | None = None,
                scheduler_host: str | None = None, index: int | None = None) -> list[str]:
    """The command line that runs the helper for these processes."""
    argv = [python, "-m", "tfkv.launcher.role"]
    if rank_var:
        argv += ["--rank-var", rank_var]
    if index is not None:
        argv += ["--index", str(index)]
    if scheduler_host:
        argv += ["--scheduler-host", scheduler_host]
    return argv + ["--plan", json.dumps(table(plan, first), separators=(",", ":"))]


# -- the helper ------------------------------------------------------------------------------------

class RoleError(TfkvError):
    """The helper cannot tell which role to run; the message says why."""


def rank_from_env(env: dict[str, str], rank_var: str | None = None) -> int:
    """This process's 0-based rank in the job, from the resource manager's variable."""
    candidates = [(n, b) for n, b in RANK_VARS if n == rank_var] if rank_var else list(RANK_VARS)
    if rank_var and not candidates:
        candidates = [(rank_var, 0)]
    for name, base in candidates:
        value = env.get(name)
        if value is None or value == "undefined":  # SGE sets SGE_TASK_ID=undefined outside arrays
            continue
        try:
            return int(value) - base
        except ValueError:
            raise RoleError(f"{name}={value!r} is not a rank") from None
    wanted = rank_var or ", ".join(n for n, _ in RANK_VARS)
    raise RoleError(f"no rank in the environment ({wanted} unset); run this under mpirun, srun or qsub -t, "
                    "or pass --index")


def slurm_first_node_address(env: dict[str, str]) -> str:
    """The address of the step's first node, where srun puts task 0 (the scheduler)."""
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise RoleError("--scheduler-host slurm needs SLURM_STEP_NODELIST or SLURM_JOB_NODELIST; run this under srun")
    try:
        names = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                               timeout=60, check=True).stdout.split()
        node = subprocess.run(["scontrol", "-o", "show", "node", names[0]], capture_output=True, text=True,
                              timeout=60).stdout
    except (OSError, subprocess.SubprocessError, IndexError) as e:
        raise RoleError(f"cannot list the nodes of {nodelist} with scontrol ({e})") from None
    m = re.search(r"\bNodeAddr=(\S+)", node)
    addr = m.group(1) if m else names[0]  # NodeAddr: the name may not resolve (fake hosts, private nets)
    try:
        return socket.gethostbyname(addr)
    except OSError:
        return addr


def tasks_per_node(value: str) -> list[int]:
    """Slurm's `2(x3),1` -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in value.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise RoleError(f"SLURM_STEP_TASKS_PER_NODE={value!r} is not Slurm's tasks-per-node list")
        counts += [int(m[1])] * int(m[2] or 1)
    return counts


def slurm_local_rank(env: dict[str, str], rank: int, workers: range) -> dict[str, str]:
    """A worker's TFKV_LOCAL_RANK and TFKV_LOCAL_SIZE under srun (block distribution: each node
    runs consecutive ranks); `workers`: the ranks of the job's workers."""
    node_first = rank - int(env["SLURM_LOCALID"])
    local = {LOCAL_RANK: str(rank - max(node_first, workers.start))}
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if per_node:
        starts, first = {}, 0
        for n in tasks_per_node(per_node):
            starts[first], first = n, first + n
        node_end = node_first + starts.get(node_first, 0)
        local[LOCAL_SIZE] = str(max(0, min(node_end, workers.stop) - max(node_first, workers.start)))
    return local


def exit_line(name: str, code: int) -> str:
    return f"[{name}] tfkv-role: {name} {status_text(code)}"


def _pick(args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    """This rank's entry of the plan: name, argv and its full environment."""
    if args.plan:
        spec = json.loads(args.plan)
    else:
        if not args.argv:
            raise RoleError("give --plan JSON or the workers' command after --")
        try:
            servers, workers = int(env["DMLC_NUM_SERVER"]), int(env["DMLC_NUM_WORKER"])
        except (KeyError, ValueError):
            raise RoleError("DMLC_NUM_SERVER and DMLC_NUM_WORKER must be set to numbers") from None
        plan = make_plan(workers, servers, args.argv, [sys.executable, "-m", "tfkv.ps.node"], ["-"],
                         env.get("DMLC_PS_ROOT_URI", ""), int(env.get("DMLC_PS_ROOT_PORT") or 0), local_ranks=False)
        spec = table(plan)
        spec["env"] = {}  # the environment already holds the job's variables
    rank = args.index if args.index is not None else rank_from_env(env, args.rank_var)
    index = rank - int(spec.get("first", 0))
    procs = spec["procs"]
    if not 0 <= index < len(procs):
        raise RoleError(f"rank {rank} has no role: this job has {len(procs)} process(es) from rank "
                        f"{spec.get('first', 0)}; start exactly that many")
    entry = procs[index]
    own = {**spec.get("env", {}), **entry["env"]}
    if own.get("DMLC_ROLE") == "worker" and LOCAL_RANK not in own and "SLURM_LOCALID" in env:
        first = int(spec.get("first", 0))
        roles = [{**spec.get("env", {}), **p["env"]}.get("DMLC_ROLE") for p in procs]
        own.update(slurm_local_rank(env, rank, range(first + roles.index("worker"), first + len(procs))))
    return {"name": entry["name"], "argv": entry["argv"], "env": own}


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tfkv.launcher.role", description=__doc__.splitlines()[0])
    p.add_argument("--plan", help="the processes of the job as JSON (what the launchers pass)")
    p.add_argument("--rank-var", help="the variable that holds the rank (default: the first one set of "
                                      + ", ".join(n for n, _ in RANK_VARS) + ")")
    p.add_argument("--index", type=int, help="the rank, when no resource manager gives one")
    p.add_argument("--scheduler-host", choices=["slurm"],
                   help="slurm: the scheduler is on the first node of the step; find its address")
    p.add_argument("argv", nargs=argparse.REMAINDER, help="the workers' command, after --")
    args = p.parse_args(argv)
    args.argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    # Die with whatever started us (orted, slurmstepd, sge_shepherd): SIGHUP, stop now, passed on
    # below (SIGTERM would be taken for a batch system's preemption).
    parent = os.getppid()
    die_with_parent(signal.SIGHUP)
    if os.getppid() != parent:  # it died before we asked
        sys.exit(128 + signal.SIGHUP)
    env = dict(os.environ)
    try:
        entry = _pick(args, env)
        env.update(entry["env"])
        if args.scheduler_host == "slurm":
            env["DMLC_PS_ROOT_URI"] = slurm_first_node_address(env)
    except (RoleError, ValueError, KeyError) as e:
        print(f"tfkv-role: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    sys.exit(run_role(entry["name"], entry["argv"], env, sge=(args.rank_var == "SGE_TASK_ID")))


def run_role(name: str, argv: list[str], env: dict[str, str], sge: bool = False) -> int:
    """Run one role with prefixed output; its exit status as this process's (128+N for signal N)."""
    out = sys.stdout.buffer
    prefix = f"[{name}] ".encode()
    try:
        # SIGKILL when we die: the resource manager killed us hard, so the role must go at once.
        child = subprocess.Popen(argv, env={**env, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                 preexec_fn=lambda: die_with_parent(signal.SIGKILL))
    except OSError as e:
        out.write(prefix + f"tfkv-role: cannot start {argv[0]!r}: {e.strerror}\n".encode())
        out.write((exit_line(name, 127) + "\n").encode())
        out.flush()
        return 127

    def forward(sig: int, _frame: Any) -> None:
        signal_group(child.pid, sig)
        signal_group(child.pid, signal.SIGCONT)  # a stopped (hung) role acts on it only once resumed

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    assert child.stdout is not None
    for raw in iter(child.stdout.readline, b""):
        out.write(prefix + raw.rstrip(b"\n") + b"\n")
        out.flush()
    code = child.wait()
    signal_group(child.pid, signal.SIGKILL)  # whatever the role left behind in its group
    out.write((exit_line(name, code) + "\n").encode())
    out.flush()
    status = code if code >= 0 else 128 - code
    if sge and status in (99, 100):  # to Grid Engine, 99 means "run me again" and 100 "hold the job"
        status = 1
    return status


if __name__ == "__main__":
    main()
