"""Plan, check, record and launch one parameter-server job: what `tfkv-run cluster=...` and
`tfkv-launch` share, the launcher's core. What it does with a backend it asks of what the backend
declares (tfkv.launcher.base.Traits), never of its name. The job's knob values are resolved once
per launch (`knob_values`), recorded once (knobs.json), and handed to every role's environment
and to the backend, constructed with its settings (`backend`)."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from pathlib import Path
from typing import IO, Any, Callable, Mapping, Sequence

from tfkv import gpus, knobs, preempt
from tfkv.config import cluster
from tfkv.config.device_specs import LOCAL_RANK, bound_gpus
from tfkv.errors import ConfigError
from tfkv.launcher import base, placement, record, signals, spares
from tfkv.launcher.hosts import Host, read_hosts
from tfkv.launcher.hosts import slots as host_slots
from tfkv.launcher.plan import RUN_DIR, make_plan, worker_hosts
from tfkv.launcher.ports import free_port, release_port
from tfkv.launcher.process import repeats
from tfkv import keys as jobkeys

log = logging.getLogger("tfkv")


def schemas() -> list[type]:
    """Every launcher's settings schema: tfkv's and what the installed plug-in launchers declare
    (`config`, tfkv.launcher.base.schemas); one that fails to import is refused when chosen."""
    return list(base.schemas(plugins=True).values())


# The job's options: every launcher's cluster settings, defined once in its schema (tfkv.config.cluster,
# a backend's module, a plug-in's); launcher, num_workers, num_servers,
# hostfile, sync_dst_dir and interface lead, in the order callers pass them positionally.
Options = dataclasses.make_dataclass("Options", [
    (f.name, f.type, dataclasses.field(default=f.default, metadata=f.metadata))
    for f in cluster.options(*schemas(), first=(
        "launcher", "num_workers", "num_servers", "hostfile", "sync_dst_dir", "interface"))])


def remote_path(opts: Options, workdir: Path, path: Path) -> str:
    """Where `path` (under the working directory) is on the hosts once the tree is synced."""
    if opts.sync_dst_dir and Path(path).resolve().is_relative_to(Path(workdir).resolve()):
        return str(Path(opts.sync_dst_dir) / Path(path).resolve().relative_to(Path(workdir).resolve()))
    return str(path)


def requeues_itself(opts: Options) -> bool:
    """Whether the job may run again without this launcher after a preemption (the slurm
    backend's batch job requeues itself: tfkv.launcher.backends.slurm.batch_script)."""
    return base.backend_class(opts.launcher).requeues_itself()


def knob_values(opts: Options, settings: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Every backend knob's effective value for this job (tfkv.knobs): the launching shell's
    variable, else `settings` (tfkv-run: the config's kvstore.* and cluster.* keys), else the
    job options' (tfkv-launch: its flags), else the knob's default."""
    given = {k.key: getattr(opts, k.setting) for k in knobs.KNOBS
             if k.key.startswith("cluster.") and hasattr(opts, k.setting)}
    return knobs.resolve({**given, **(settings or {})}, os.environ)


def backend(opts: Options, values: Mapping[str, Any] | None = None) -> base.Backend:
    """The job's launcher, constructed with its settings (its `config` schema): each a knob's
    effective value (`values`, from `knob_values`) where it is a knob, else the job's option."""
    values = knob_values(opts) if values is None else values
    cls = base.backend_class(opts.launcher)
    given = {}
    for f in dataclasses.fields(cls.config):
        key = f"cluster.{f.name}"
        if key in knobs.BY_KEY:
            given[f.name] = values[key]
        elif hasattr(opts, f.name):
            given[f.name] = getattr(opts, f.name)
    return cls(cls.config(**given))


def place_workers(opts: Options, hosts: list[Host], traits: base.Traits, servers: Sequence[str] = ()) -> list[str]:
    """Each worker's host (tfkv.launcher.plan.worker_hosts) with the job's slots and
    cluster.workers_per_host, on the hosts that are not `servers` (server hosts); slots and
    workers_per_host are refused where a resource manager picks the nodes."""
    if servers:  # the workers' hosts alone, placed from their first (no server ahead of them to skip)
        hosts = [h for h in hosts if h.name not in servers]
        return worker_hosts(opts.num_workers, 0, [h.name for h in hosts], opts.workers_per_host,
                            host_slots(hosts), f"the worker hosts of {opts.hostfile}")
    per_host, slots = opts.workers_per_host, host_slots(hosts)
    if traits.chooses_nodes and (per_host is not None or slots):
        what = f"cluster.workers_per_host={per_host}" if per_host is not None else f"slots= in {opts.hostfile}"
        raise ConfigError(f"{what} places workers on hosts, but with --launcher {opts.launcher} the resource "
                          "manager picks the nodes; ask it for tasks per node instead (e.g. srun_args=--ntasks-per-node=N)")
    if per_host is not None and per_host < 1:
        raise ConfigError(f"cluster.workers_per_host={per_host} must be at least 1, or null (round robin)")
    source = f"hosts file {opts.hostfile}" if opts.hostfile else f"this machine ({opts.host}, no hosts file)"
    return worker_hosts(opts.num_workers, opts.num_servers, [h.name for h in hosts], per_host, slots, source)


def _secrets(opts: Options, traits: base.Traits, workdir: Path, run_dir: Path, write: bool = True) -> dict[str, str]:
    """The variables that give every role the job's keys (or say there are none); `write`: false
    for a dry run, which names the key file without writing it."""
    if not opts.secure:
        log.warning(jobkeys.INSECURE_WARNING)
        return {jobkeys.SECURE: "0"}
    keys = jobkeys.new_keys()
    if traits.secrets_by_env:
        # local: the children's environment (not shown by ps); ssh: sent over the channel's
        # stdin, see tfkv.launcher.backends.ssh. Never on a command line, never in the record.
        return jobkeys.keys_env(keys)
    # mpirun/srun/qsub/yarn may put environment values on command lines: a file only the
    # user can read, on the run directory (shared by the hosts with these launchers).
    path = Path(run_dir) / "launch" / "curve.key"
    path = jobkeys.write_keyfile(path, keys) if write else path
    return {jobkeys.KEYFILE: remote_path(opts, workdir, path)}


def plan_job(opts: Options, worker_argv: list[str], workdir: Path, run_dir: Path,
             env: Mapping[str, str] | None = None, values: Mapping[str, Any] | None = None) -> base.Job:
    """The job's plan; `env` goes to every role (tfkv-run: the workers' config), and so do the
    role knobs of `values` (the job's knob values, `knob_values`; resolved here when not given).
    A dry run's (`opts.dry_run`) writes no key file."""
    traits = base.traits(opts.launcher)
    if opts.hostfile:
        hosts = read_hosts(opts.hostfile)
    elif traits.needs_hostfile:
        raise ConfigError(f"the {opts.launcher} launcher needs a hosts file: -H hosts / cluster.hostfile=hosts")
    else:
        hosts = [Host(opts.host)]  # mpi without one: this machine, as a bare mpirun runs
    servers = placement.server_hosts(opts.launcher, opts.hostfile, hosts, opts.server_hosts,
                                     opts.num_servers)
    placement.check_cpus(opts.server_cpus, opts.worker_cpus)
    here = traits.runs_here
    python = sys.executable if here else opts.python
    scheduler_host = opts.host if here or not opts.hostfile else (servers or [hosts[0].name])[0]
    port = opts.port or free_port(opts.host if here else "0.0.0.0")
    values = knob_values(opts) if values is None else values
    extra = {**(env or {}), **knobs.environment(values), RUN_DIR: remote_path(opts, workdir, run_dir),
             **_secrets(opts, traits, workdir, run_dir, write=not opts.dry_run)}
    # Only a backend that places roles on the hosts file's hosts names them; a resource manager chooses its own.
    placed = bool(opts.hostfile) and traits.places_roles
    workers = place_workers(opts, hosts, traits, servers)
    plan = make_plan(opts.num_workers, opts.num_servers, worker_argv, [python, "-m", "tfkv.ps.node"],
                     [h.name for h in hosts], scheduler_host, port, extra, show_host=placed,
                     placed_workers=workers, local_ranks=traits.local_ranks, server_hosts=servers,
                     cpus=(opts.server_cpus, opts.worker_cpus))
    return base.Job(plan=plan, hosts=hosts if opts.hostfile else [], workdir=workdir,
                    sync_dst_dir=opts.sync_dst_dir, run_dir=run_dir, python=python,
                    remote_run_dir=remote_path(opts, workdir, run_dir))


def pin_scheduler(job: base.Job) -> None:
    """DMLC_PS_ROOT_URI of every role: the address the scheduler's host reported in the
    pre-flight, not the name the hosts file gives it (an ssh alias only the launcher's ssh
    resolves; the scheduler would try to listen on it and the other hosts could not find it)."""
    address = job.addresses.get(job.plan[0].host) if job.plan else None
    if address:
        for p in job.plan:
            p.env["DMLC_PS_ROOT_URI"] = address


def check_gpus(traits: base.Traits, job: base.Job, versions: Mapping[str, Mapping[str, Any]]) -> None:
    """Before anything starts: no worker's devices ({local_rank}, {rank}) name a GPU its host
    lacks, as the pre-flight counted them there (tfkv.gpus; the local launcher's host reports as
    "localhost"). Where the plan gives no local rank (Slurm, SGE, YARN) or a host's count is
    unknown, each worker checks for itself when it binds (tfkv.parallel.binding)."""
    for p in job.plan:
        if p.role != "worker" or LOCAL_RANK not in p.env or not job.devices:
            continue
        local_rank = int(p.env[LOCAL_RANK])
        wanted = bound_gpus(job.devices, p.rank, local_rank)
        found = _seen(versions, p.host, traits).get("gpus")
        if wanted is not None and found is not None and max(wanted) >= found:
            raise gpus.beyond(job.devices, wanted, found, f"{p.name} (local rank {local_rank})",
                              f"the pre-flight on {p.host}")


def _seen(versions: Mapping[str, Mapping[str, Any]], host: str, traits: base.Traits) -> Mapping[str, Any]:
    """What the pre-flight found on `host` (the local launcher's reports as "localhost"), or {}."""
    return versions.get(host) or (versions.get("localhost") if traits.runs_here else None) or {}


def describe(job: base.Job) -> str:
    by_host: dict[str, list[str]] = {}
    for p in job.plan:
        by_host.setdefault(p.host, []).append(p.name.split(" @")[0])
    return "; ".join(f"{host}: {', '.join(names)}" for host, names in by_host.items())


def dry_run(opts: Options, worker_argv: list[str], workdir: Path, run_dir: Path, out: IO[str],
            env: Mapping[str, str] | None = None, settings: Mapping[str, Any] | None = None) -> base.Result:
    """What `launch` would run, printed to `out`: the plan, then the backend's request (every
    command, with its environment, and every script; the job's keys shown as a stand-in). Nothing
    starts and nothing is written: no pre-flight, no record, no key file."""
    opts = dataclasses.replace(opts, dry_run=True)
    values = knob_values(opts, settings)
    launcher = backend(opts, values)
    job = plan_job(opts, worker_argv, workdir, run_dir, env, values)
    try:
        request = launcher.request(job, Path(run_dir) / "launch" / opts.launcher, f"tfkv-{opts.launcher}-dry-run")
    except NotImplementedError as e:
        raise ConfigError(f"{e}; drop --dry-run / cluster.dry_run") from None
    finally:
        release_port(int(job.plan[0].env["DMLC_PS_ROOT_PORT"]))
    out.write(f"tfkv: dry run of a {opts.launcher} job, {opts.num_servers} server(s), {opts.num_workers} worker(s) - "
              f"{describe(job)}; nothing is started\n{request.text()}")
    out.flush()
    return base.Result(0, None)


def launch(opts: Options, worker_argv: list[str], workdir: Path, run_dir: Path, argv: Sequence[str],
           out: IO[str], env: Mapping[str, str] | None = None,
           settings: Mapping[str, Any] | None = None,
           again: Callable[[base.Result], Mapping[str, str] | None] | None = None,
           devices: Sequence[str] | None = None, preemptible: bool = True) -> base.Result:
    """Plan, print the plan, check every host, write the record (and knobs.json), run the job
    (`env`: more variables for every role; `settings`: the config's knobs, see `knob_values`,
    resolved once for the whole launch;
    `devices`: the workers', checked against each host's GPUs, see `check_gpus`).
    The result's returncode is 128 + N when signal N (Ctrl-C, SIGTERM) stopped the job.
    `preemptible`: the first SIGTERM asks the job to checkpoint and end instead (tfkv.launcher.signals;
    not for a trial of a sweep, where SIGTERM ends the sweep).

    With `opts.max_restarts`, a job that failed (not one a signal stopped, nor a role's own error
    that a restart would meet again: tfkv.launcher.process.repeats) is torn down as ever,
    then planned and started again, up to that many times (the result's `restarts` says when
    they were spent or why none was tried): each restart is a line naming the
    cause and an entry of launch/restarts.json. `again(result)` gives the roles' `env` for the
    next attempt (tfkv-run: the newest checkpoint to resume), or None for no restart. A host
    whose roles failed twice is left out of the next attempt for one of `opts.spare_hosts`
    (tfkv.launcher.spares), said in the restart's line and entry. With `opts.dry_run`: `dry_run`."""
    if opts.dry_run:
        return dry_run(opts, worker_argv, workdir, run_dir, out, env, settings)
    spare = spares.Spares(spares.check(opts.launcher, opts.hostfile, opts.spare_hosts))
    hosts = [h.name for h in read_hosts(opts.hostfile)] if spare.left else []
    values = knob_values(opts, settings)  # once per launch: every attempt's roles and backend, knobs.json
    attempt_opts, restarts = opts, 0
    while True:
        launcher = backend(attempt_opts, values)
        job = plan_job(attempt_opts, worker_argv, workdir, run_dir, env, values)
        job.devices = list(devices) if devices else None
        if not restarts:
            knobs.record(run_dir, values)
        result = _attempt(attempt_opts, job, launcher, run_dir, argv, out, preemptible)
        if result.failure is None or result.returncode > 128 or not opts.max_restarts:
            return result
        if (Path(run_dir) / preempt.DONE).exists():  # preempted: its owner or Slurm starts it again
            return result
        done = f"after {restarts} restart(s), " if restarts else ""
        if repeats(result.failure):
            return dataclasses.replace(result, restarts=(
                f"{done}not restarted: a role's own error, which a restart meets again (cluster.max_restarts "
                "restarts a job whose role was killed (a preemption too) or lost, or whose host went down)"))
        if restarts >= opts.max_restarts:
            return dataclasses.replace(result, restarts=f"all {restarts} restart(s) of cluster.max_restarts spent")
        following = again(result) if again is not None else dict(env or {})  # the same job again
        if following is None:
            return result
        restarts += 1
        spare.failed(result.failure, hosts)
        swaps = spare.replace(hosts)
        if swaps:
            attempt_opts = dataclasses.replace(opts, hostfile=str(spare.hosts_file(
                opts.hostfile, Path(run_dir) / "launch" / f"hosts.attempt-{restarts + 1}")))
        said = "".join(f"; {host} failed in {spares.FAILURES} attempts, spare host {new} takes its place"
                       for host, new in swaps)
        out.write(f"tfkv: restart {restarts} of {opts.max_restarts}: {result.failure}{said}\n")
        out.flush()
        record.restart(run_dir, restarts, result.failure, dict(swaps))
        env = following


def _attempt(opts: Options, job: base.Job, launcher: base.Backend, run_dir: Path, argv: Sequence[str],
             out: IO[str], preemptible: bool = True) -> base.Result:
    try:
        return _launch(opts, job, launcher, run_dir, argv, out, preemptible)
    finally:
        # the scheduler's port, leased to this process by plan_job: another job may have it now
        release_port(int(job.plan[0].env["DMLC_PS_ROOT_PORT"]))


def _launch(opts: Options, job: base.Job, launcher: base.Backend, run_dir: Path, argv: Sequence[str],
            out: IO[str], preemptible: bool = True) -> base.Result:
    out.write(f"tfkv: {opts.launcher} job, {opts.num_servers} server(s), {opts.num_workers} worker(s) - "
              f"{describe(job)}\n")
    out.flush()
    versions = launcher.preflight(job)
    traits = base.Traits.of(type(launcher))
    check_gpus(traits, job, versions)
    placement.check_on_hosts(job.plan, {h: _seen(versions, h, traits).get("cpus") for h in {p.host for p in job.plan}},
                             opts.server_cpus, opts.worker_cpus)
    pin_scheduler(job)
    record.write(run_dir, opts.launcher, job, argv, versions, opts.hostfile)
    tee = record.Tee(out, run_dir / "launch" / "job.log")
    result: base.Result | None = None
    try:
        with signals.stop_once(preempt=(lambda: _preempt(run_dir)) if preemptible else None) as stop:
            try:
                result = launcher.launch(job, tee)
            except KeyboardInterrupt as e:  # after the backend's own teardown, or before it started any
                result = base.Result(1, signals.failure(e))
        # Every backend: a job stopped by a signal ends as a process killed by it (130, 143).
        if stop.status:
            return base.Result(stop.status, result.failure)
        reason = record.said(tee.path, result.failure) if result.failure else None  # the log is line-buffered
        return dataclasses.replace(result, failure=f"{result.failure}: {reason}") if reason else result
    finally:
        tee.close()
        if not (result is not None and result.requeued):  # a requeued job's script removes them at its end
            (Path(run_dir) / "launch" / "curve.key").unlink(missing_ok=True)  # the job's keys die with it


def _preempt(run_dir: Path) -> None:
    """The launcher's first SIGTERM: worker 0 is asked to checkpoint at its next step and end the
    job (the flag in the run directory), and the user is told how to stop it now. Written with
    os.write: a signal handler must not enter a buffered stream another write may be inside."""
    preempt.ask(run_dir, "SIGTERM")
    os.write(2, (f"tfkv: SIGTERM: worker 0 checkpoints at its next step and ends the job (within "
                 f"{preempt.GRACE:.0f} s); a second SIGTERM or Ctrl-C stops it now\n").encode())
