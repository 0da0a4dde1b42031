"""`--launcher sge`: servers and workers as one Grid Engine array job, as dmlc-core's SGE tracker.

The scheduler runs on the submitting machine, like dmlc's tracker, through the role helper in its
own process group: its address is then known before anything is queued (the plan's
DMLC_PS_ROOT_URI: for execution hosts other than this one, give a hosts file whose first line is
this machine's address, or cluster.host=...). The servers and workers are the tasks of one array
job, `qsub -t 1-(S+W)`; each runs the role helper, which maps SGE_TASK_ID to the plan: tasks
1..S the servers, the rest the workers. `-V` passes the job's variables (and the launcher's
TFKV_*/DMLC_*/... ones) to every task; `-sync y` makes qsub wait for the whole array.

Each task writes its output (already prefixed with its role by the helper) to
launch/sge/task-<id>.log in the run directory, which the launcher follows and merges, so the
run directory must be on a file system the execution hosts share (/tmp when there is none).

Teardown: when a role fails, the others learn it from the scheduler and exit; after a grace period
the launcher deletes the job (`qdel <unique job name>`), which kills whatever task is left, and
stops the local scheduler's process group. Ctrl-C or SIGTERM does the same at once. The helper
passes signals on to its role and dies with the shepherd, and maps exit codes 99 and 100 (which
would make Grid Engine rerun or hold the task) to 1. Site-specific flags: cluster.qsub_args (TFKV_QSUB_ARGS; e.g.
"-q gpu.q -l h_vmem=4G").
"""

from __future__ import annotations

import os
import shlex
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Mapping

from tfkv.config.cluster import RemoteCluster, knob
from tfkv.launcher import role, supervisor
from tfkv.launcher.backends import batch
from tfkv.launcher.base import Backend, Job, Program, Result
from tfkv.launcher.process import status_text
from tfkv.launcher.record import local_versions
from tfkv.launcher.request import Command, Request

TEARDOWN = 30.0  # seconds Grid Engine gets to end the job after qdel


def task_script(job: Job) -> str:
    """The array job's script: every task runs the helper, which picks its role by SGE_TASK_ID."""
    helper = role.helper_argv(job.python, job.plan[1:], rank_var="SGE_TASK_ID")
    return ("#!/bin/bash\n"
            "# tfkv: the servers and workers of one job; SGE_TASK_ID decides the role.\n"
            f"exec {shlex.join(helper)}\n")


def qsub_argv(job: Job, name: str, script: str, logs: Path, qsub_args: str = "") -> list[str]:
    return ["qsub", "-sync", "y", "-t", f"1-{len(job.plan) - 1}", "-N", name, "-V", "-wd", str(job.workdir),
            "-j", "y", "-o", f"{logs}/task-$TASK_ID.log", "-S", "/bin/bash",
            *shlex.split(qsub_args), script]



@dataclass
class SGECluster(RemoteCluster):
    """cluster=sge's settings: those of launchers that reach other hosts, and qsub's flags."""

    qsub_args: str = knob("cluster.qsub_args")


class SGELauncher(Backend):
    """The scheduler here; servers and workers as the tasks of one Grid Engine array job."""

    name = "sge"
    config = SGECluster
    chooses_nodes = True
    local_ranks = False  # Grid Engine gives a task no index on its host
    programs = tuple(Program(name, "install the Grid Engine client (apt-get install gridengine-client) or source "
                                   "$SGE_ROOT/$SGE_CELL/common/settings.sh") for name in ("qsub", "qdel"))

    def preflight(self, job: Job) -> dict[str, dict[str, str]]:
        self.need()
        return {"localhost": local_versions()}

    def request(self, job: Job, files: Path, name: str = "tfkv",
                environ: Mapping[str, str] | None = None) -> Request:
        """The array job's script in `files`; the scheduler here, then the qsub that queues the rest."""
        script = files / "job.sh"
        env, cwd = {**role.common_env(job.plan), "PYTHONUNBUFFERED": "1"}, str(job.workdir)
        return Request([Command("scheduler", role.helper_argv(sys.executable, job.plan[:1], index=0), env, cwd=cwd),
                        Command("qsub", qsub_argv(job, name, str(script), files, self.settings.qsub_args), env,
                                cwd=cwd)],
                       {str(script): task_script(job)})

    def launch(self, job: Job, out: IO[str]) -> Result:
        self.need()
        name = batch.job_name("sge")
        files = batch.job_files(job.run_dir, "sge")
        request = self.request(job, files, name)
        request.write()
        tasks = len(job.plan) - 1
        for i in range(1, tasks + 1):
            (files / f"task-{i}.log").unlink(missing_ok=True)
        env = request.command("qsub").environ(os.environ)
        output = batch.Output(out, [p.name for p in job.plan])
        done = threading.Event()
        for i in range(1, tasks + 1):
            output.tail(files / f"task-{i}.log", done)
        scheduler = batch.start(request.command("scheduler").argv, env=env, cwd=str(job.workdir))
        output.pump(scheduler.stdout)
        output.pump(scheduler.stderr, "[scheduler] ")
        qsub = batch.start(request.command("qsub").argv, env=env, cwd=str(job.workdir))
        output.pump(qsub.stdout, "[qsub] ")
        output.pump(qsub.stderr, "[qsub] ")

        def scheduler_ends() -> str | None:
            if qsub.returncode == 0 and not output.ends.failed:
                return batch.scheduler_ends(scheduler, "every task of the Grid Engine job finished")
            return None

        def teardown() -> None:
            if qsub.poll() is None:
                batch.quietly(["qdel", name], env, timeout=60)
            batch.stop(qsub, grace=TEARDOWN, first=0)  # qsub -sync y returns once the job is gone
            batch.stop(scheduler)
            done.set()
            output.join()

        failure = supervisor.supervise(output.ends, lambda: qsub.poll() is not None, teardown,
                                       then=scheduler_ends, interval=0.1)
        if failure is None and qsub.returncode:
            detail = output.last.get("[qsub] ")
            failure = f"the Grid Engine job {status_text(qsub.returncode)}" + (f" ({detail})" if detail else "")
        return Result(supervisor.returncode(failure), failure)
