"""`--launcher slurm`: the whole job as one Slurm job step, `srun -n 1+S+W`.

Every task runs the role helper (`python -m tfkv.launcher.role`), which maps its SLURM_PROCID to
the plan: task 0 the scheduler, tasks 1..S the servers, the rest the workers. Slurm, not the
launcher, picks the nodes, so the helper finds the scheduler's address itself: srun puts task 0 on
the first node of the step, whose NodeAddr `scontrol` gives. The port is the launcher's choice
(DMLC_PS_ROOT_PORT of the plan). Roles get the job's variables through the environment srun passes
on (`--export=ALL`), including the launcher's TFKV_*/DMLC_*/... ones.

Inside an allocation (SLURM_JOB_ID set: under salloc, in a batch script, or in a job step such as
the one hydra-submitit-launcher runs each trial of a sweep in) the launcher runs that srun itself
and streams its output. From inside a step (SLURM_STEP_ID set) the roles' step overlaps it
(`--overlap`): the step running tfkv-run holds the allocation's CPUs, and without it the roles'
step would wait for them forever; the variables that shaped that step's one task
(--ntasks-per-node, --cpus-per-task) are not passed on to the roles' step. An allocation with
fewer CPUs than the job has tasks (srun gives each task one) is refused in one line before
anything starts.

Outside an allocation the launcher submits a batch script that runs the same srun
(`sbatch --wait`, so the launcher waits for the job and gets its exit code) and streams the job's
output file back, which therefore has to be on a file system the launcher sees (the run directory's
launch/slurm/, or /tmp when there is none). That script passes Slurm's warning ahead of a
preemption (`--signal=B:USR1@N`) on as the run directory's preemption flag and, once worker 0
checkpointed and stopped the job, requeues the job itself (`batch_script`): the launcher then
leaves it be (its workers resume by themselves, resume=auto) and exits 75. A preempted tfkv-run
inside an allocation requeues the allocation's job (tfkv.launcher.requeue).

Teardown: `--kill-on-bad-exit=1` makes Slurm kill every task as soon as one exits non-zero. On
Ctrl-C (or a second SIGTERM: the first is a preemption, tfkv.launcher.signals) the launcher
cancels the job (`scancel --name`, as the job's unique name is known before its id) or, inside an
allocation, interrupts srun twice, which makes srun kill the step. Slurm kills each task's
whole process tree; the helper also passes signals on to its role.
Site-specific flags: cluster.srun_args and cluster.sbatch_args (TFKV_SRUN_ARGS, TFKV_SBATCH_ARGS;
e.g. "-p gpu --time 1:00:00").
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Mapping

from tfkv import preempt
from tfkv.config.cluster import RemoteCluster, knob
from tfkv.errors import ConfigError
from tfkv.keys import KEYFILE
from tfkv.launcher import requeue, role, supervisor
from tfkv.launcher.backends import batch
from tfkv.launcher.base import Backend, Job, Program, Result
from tfkv.launcher.process import signal_group, status_text
from tfkv.launcher.record import local_versions
from tfkv.launcher.request import Command, Request

TEARDOWN = 15.0  # seconds Slurm gets to end the step or job after we ask


# What srun reads from the environment of a step to shape its tasks: inherited from the step that
# runs tfkv-run (submitit's `srun python -m submitit...`, one task holding every CPU), they would
# shape the roles' tasks too (srun warns it cannot honour --ntasks-per-node=1; Slurm >= 23.11
# reads SLURM_CPUS_PER_TASK again and would ask tasks x CPUs of the whole allocation).
STEP_SHAPE = ("SLURM_NTASKS_PER_NODE", "SLURM_CPUS_PER_TASK", "SRUN_CPUS_PER_TASK")


def in_allocation(environ: dict[str, str] | None = None) -> bool:
    return bool((os.environ if environ is None else environ).get("SLURM_JOB_ID"))


def in_step(environ: dict[str, str] | None = None) -> bool:
    """Running as a task of a job step (srun), not in the allocation's batch script or salloc's shell."""
    return bool((os.environ if environ is None else environ).get("SLURM_STEP_ID"))


def allocation_cpus(environ: dict[str, str] | None = None) -> int | None:
    """CPUs of this allocation on all its nodes, from SLURM_JOB_CPUS_PER_NODE ("8(x2),4": two nodes
    with 8, one with 4); None when Slurm did not say."""
    total = 0
    for part in (os.environ if environ is None else environ).get("SLURM_JOB_CPUS_PER_NODE", "").split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            return None
        total += int(m[1]) * int(m[2] or 1)
    return total or None


def job_label(environ: dict[str, str] | None = None) -> str:
    """This allocation as squeue shows it: "7", or "7 (array task 6_0)" for a task of a job array
    (hydra-submitit-launcher submits a sweep's trials as one)."""
    environ = os.environ if environ is None else environ
    label = environ.get("SLURM_JOB_ID", "?")
    if environ.get("SLURM_ARRAY_JOB_ID") and environ.get("SLURM_ARRAY_TASK_ID"):
        label += f" (array task {environ['SLURM_ARRAY_JOB_ID']}_{environ['SLURM_ARRAY_TASK_ID']})"
    return label


def check_allocation(job: Job, environ: dict[str, str] | None = None) -> None:
    """Refuse, in one line, an allocation with fewer CPUs than the job has tasks: srun would fail
    with 'More processors requested than permitted' (or, beside a step, wait for CPUs forever);
    and a step that runs this launcher as several tasks (submitit with nodes or tasks_per_node
    above 1 calls its function in each): every copy would start the whole job."""
    environ = os.environ if environ is None else environ
    copies = int(environ.get("SLURM_STEP_NUM_TASKS") or 1) if in_step(environ) else 1
    if copies > 1:
        raise ConfigError(
            f"tfkv runs as {copies} tasks of step {environ['SLURM_STEP_ID']} of Slurm job {job_label(environ)}, and "
            "each would start the whole job: run it as one task (with hydra/launcher=submitit_slurm: "
            "hydra.launcher.nodes=1 hydra.launcher.tasks_per_node=1, the defaults)")
    cpus, tasks = allocation_cpus(environ), len(job.plan)
    if cpus is None or cpus >= tasks:
        return
    servers = sum(p.role == "server" for p in job.plan)
    raise ConfigError(
        f"the Slurm allocation of job {job_label(environ)} has {cpus} CPU(s), and the job's {tasks} tasks "
        f"(scheduler, {servers} server(s), {tasks - 1 - servers} worker(s)) need one each: allocate {tasks}, "
        f"e.g. salloc -n {tasks}, or with hydra/launcher=submitit_slurm hydra.launcher.cpus_per_task={tasks}")


def srun_argv(job: Job, name: str, environ: Mapping[str, str] | None = None, srun_args: str = "") -> list[str]:
    """The one srun that runs every role of the plan as a task of one step (`srun_args`: cluster.srun_args)."""
    environ = os.environ if environ is None else environ
    overlap = ["--overlap"] if in_step(environ) else []
    return ["srun", "-n", str(len(job.plan)), *overlap, "--kill-on-bad-exit=1", "--export=ALL", "-J", name,
            "--chdir", str(job.workdir), *shlex.split(srun_args),
            *role.helper_argv(job.python, job.plan, rank_var="SLURM_PROCID", scheduler_host="slurm")]


def batch_script(job: Job, name: str, environ: Mapping[str, str] | None = None, srun_args: str = "") -> str:
    """The batch job: the srun of every role. Slurm's warning ahead of a preemption or the time
    limit (`--signal=B:USR1@N` in cluster.sbatch_args) comes to this script alone, which leaves
    the run directory's preemption flag for worker 0 (tfkv.preempt): it
    checkpoints at its next step and stops the job, and tfkv-run exits 75; the script then
    requeues its job (`python -m tfkv.launcher.requeue`, where Slurm may requeue it: sbatch
    --requeue), keeping the job's key file for the next run, and waits for Slurm to end it. (Not
    SIGTERM, Slurm's stop to every process of the job: srun takes it as the order to kill its
    step at once, so the warning ahead of it is what saves the step.)"""
    run_dir = Path(job.remote_run_dir or job.run_dir or ".")
    flag = shlex.quote(str(run_dir / preempt.FLAG))
    keyfile = role.common_env(job.plan).get(KEYFILE)
    return ("#!/bin/bash\n"
            f"# tfkv: every role of the job as one srun step; SLURM_PROCID decides the role.\n"
            f"trap 'echo SIGUSR1 > {flag}' USR1\n"
            f"{shlex.join(srun_argv(job, name, environ, srun_args))} &\n"
            "while wait $!; rc=$?; [ $rc -gt 128 ] && kill -0 $! 2>/dev/null; do :; done  # a trap ended a wait\n"
            "# worker 0 checkpointed and stopped the job: requeue it (Slurm then ends this script), and the\n"
            "# workers, with resume=auto, continue from the checkpoint when it runs again\n"
            f"if [ -e {shlex.quote(str(run_dir / preempt.DONE))} ] && "
            f"{shlex.quote(job.python)} -m tfkv.launcher.requeue {shlex.quote(str(run_dir))}; then exec sleep 600; fi\n"
            + (f"rm -f {shlex.quote(keyfile)}  # the job's keys die with it\n" if keyfile else "")
            + "exit $rc\n")


def sbatch_argv(job: Job, name: str, script: str, output: str, sbatch_args: str = "") -> list[str]:
    return ["sbatch", "--wait", "-J", name, "-n", str(len(job.plan)), "-o", output, "--open-mode=append",
            "--chdir", str(job.workdir),
            "--export=ALL", *shlex.split(sbatch_args), script]



@dataclass
class SlurmCluster(RemoteCluster):
    """cluster=slurm's settings: those of launchers that reach other hosts, and srun's and sbatch's flags."""

    srun_args: str = knob("cluster.srun_args")
    sbatch_args: str = knob("cluster.sbatch_args")


class SlurmLauncher(Backend):
    """The job as one srun step, in this allocation or in a batch job of its own."""

    name = "slurm"
    config = SlurmCluster
    chooses_nodes = True
    local_ranks = False  # the role helper finds it (SLURM_LOCALID)
    programs = tuple(Program(name, "install the Slurm client (apt-get install slurm-client) or run on a Slurm login "
                                   "node") for name in ("srun", "scontrol", "sbatch", "squeue", "scancel"))

    @classmethod
    def requeues_itself(cls, environ: dict[str, str] | None = None) -> bool:
        """Outside an allocation: the batch job it submits requeues itself after a preemption (batch_script)."""
        return not in_allocation(environ)

    def preflight(self, job: Job) -> dict[str, dict[str, str]]:
        self.need("srun", "scontrol")
        if in_allocation():
            check_allocation(job)
        else:
            self.need("sbatch", "squeue", "scancel")
        return {"localhost": local_versions()}

    def request(self, job: Job, files: Path, name: str = "tfkv",
                environ: Mapping[str, str] | None = None) -> Request:
        """Inside an allocation: the srun of every role (a step beside this one from inside a step,
        without the variables that shaped it: STEP_SHAPE). Outside: the batch script in `files`,
        which runs that srun, and the sbatch that submits it."""
        environ = os.environ if environ is None else environ
        env, cwd = {**role.common_env(job.plan), "PYTHONUNBUFFERED": "1"}, str(job.workdir)
        if in_allocation(environ):
            return Request([Command("srun", srun_argv(job, name, environ, self.settings.srun_args), env,
                                    STEP_SHAPE if in_step(environ) else (), cwd)])
        script, log = files / "job.sh", files / "job.log"
        return Request([Command("sbatch", sbatch_argv(job, name, str(script), str(log), self.settings.sbatch_args),
                                env, cwd=cwd)],
                       {str(script): batch_script(job, name, environ, self.settings.srun_args)})

    def launch(self, job: Job, out: IO[str]) -> Result:
        name = batch.job_name("slurm")
        names = [p.name for p in job.plan]
        if in_allocation():
            srun = self.request(job, Path(job.workdir), name).command("srun")
            env = srun.environ(os.environ)
            out.write(f"tfkv: the job's {len(job.plan)} tasks run as one srun step in Slurm job {job_label(env)}\n")
            return self._step(srun, env, batch.Output(out, names))
        files = batch.job_files(job.run_dir, "slurm")
        return self._batch(job, name, files, self.request(job, files, name), batch.Output(out, names, watch=r"Submitted batch job (\d+)"))

    def _step(self, srun: Command, env: dict[str, str], output: batch.Output) -> Result:
        """srun inside the allocation we run in."""
        proc = batch.start(srun.argv, env=env, cwd=srun.cwd)
        output.pump(proc.stdout)  # the helpers' prefixed lines
        output.pump(proc.stderr, "[srun] ")

        def interrupt(p: subprocess.Popen) -> None:
            for _ in range(2):  # two SIGINTs within a second: srun kills every task of the step
                signal_group(p.pid, signal.SIGINT)
                time.sleep(0.3)

        failure = batch.supervise(proc, output, TEARDOWN, interrupt)
        return self._result(failure, output, proc.returncode, "srun", "[srun] ")

    def _batch(self, job: Job, name: str, files: Path, request: Request, output: batch.Output) -> Result:
        """sbatch a script that runs the srun; follow its output file; scancel on the way out."""
        sbatch = request.command("sbatch")
        env = sbatch.environ(os.environ)
        log = files / "job.log"  # sbatch -o
        request.write()
        log.unlink(missing_ok=True)
        proc = batch.start(sbatch.argv, env=env, cwd=sbatch.cwd)
        output.pump(proc.stdout, "[sbatch] ")
        output.pump(proc.stderr, "[sbatch] ")
        done = threading.Event()
        output.tail(log, done)
        over = False  # the job ended and we stopped sbatch --wait ourselves: its status says nothing
        requeued = False  # preempted, the job requeued itself (batch_script): it goes on without us

        def ended() -> bool:
            nonlocal requeued
            # sbatch --wait notices the end only at its next poll (seconds): once every role
            # ended, or one failed (Slurm then kills the rest), ask squeue.
            done = not output.ends.running() or output.ends.failed
            if done and output.found and (Path(job.run_dir or ".") / preempt.DONE).exists():
                # a job this launcher submitted starts with no restarts: one now is the script's requeue
                requeued = requeued or int(requeue.job_fields(output.found[0], env).get("Restarts") or 0) > 0
            return requeued or proc.poll() is not None or bool(done and output.found and
                                                                self._gone(output.found[0], env))

        def teardown() -> None:
            nonlocal over
            if requeued:  # not cancelled; sbatch --wait would wait for its next run: killed, which leaves the job be
                batch.stop(proc, grace=0, first=signal.SIGKILL)
                done.set()
                output.join()
                return
            if proc.poll() is None:
                if not (output.found and self._gone(output.found[0], env)):
                    batch.quietly(["scancel", "--name", name], env, timeout=60)
                deadline = time.monotonic() + TEARDOWN
                while (proc.poll() is None and time.monotonic() < deadline
                       and not (output.found and self._gone(output.found[0], env))):
                    time.sleep(0.2)
                over = proc.poll() is None
            batch.stop(proc, grace=TEARDOWN)
            done.set()
            output.join()

        failure = supervisor.supervise(output.ends, ended, teardown, extra=TEARDOWN, interval=0.1)
        if requeued:
            return Result(supervisor.returncode(failure or "preempted"), failure or "preempted", requeued=True)
        return self._result(failure, output, None if over else proc.returncode, "the Slurm job", "[sbatch] ")

    @staticmethod
    def _gone(job_id: str, env: dict[str, str]) -> bool:
        """The job has left the queue (squeue lists pending, running and completing jobs only)."""
        try:
            return not subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], env=env, capture_output=True,
                                      text=True, timeout=30).stdout.strip()
        except subprocess.TimeoutExpired:
            return False

    @staticmethod
    def _result(failure: str | None, output: batch.Output, rc: int | None, what: str, prefix: str) -> Result:
        if failure is None and rc:
            detail = output.last.get(prefix)
            failure = f"{what} {status_text(rc)}" + (f" ({detail})" if detail else "")
        return Result(supervisor.returncode(failure), failure)
