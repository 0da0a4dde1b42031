"""Run a plan as processes on this machine: merged, prefixed output; no process outlives the job.

Every role runs in its own session (process group) and is killed with the launcher if the
launcher dies (PR_SET_PDEATHSIG). tfkv.launcher.supervisor waits for the job, names what failed
first and tears every group down (SIGHUP, then SIGKILL). Ctrl-C reaches worker 0 first (SIGINT to
its group), while the other roles go on: it finishes the checkpoint it is writing, and once it ended
(22 s at most) the teardown ends the rest; a second Ctrl-C tears down at once. SIGTERM
to tfkv-run or tfkv-launch is a preemption first (tfkv.launcher.signals).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Mapping

from tfkv.config.cluster import ClusterConfig
from tfkv.launcher import supervisor
from tfkv.launcher.base import Backend, Job, Result
from tfkv.launcher.plan import NOT_FORWARDED, Process
from tfkv.launcher.request import Command, Request
from tfkv.launcher.process import die_with_parent, signal_group, warn_without_parent_death
from tfkv.launcher.record import local_versions


def _pump(name: str, stream: IO[bytes], out: IO[str], lock: threading.Lock) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        with lock:
            out.write(f"[{name}] {line}\n")
            out.flush()
    stream.close()


class LocalLauncher(Backend):
    """Every role as a process on this machine (MXNet's `--launcher local`)."""

    name = "local"
    config = ClusterConfig
    runs_here = True
    secrets_by_env = True  # the children's environment, which ps does not show

    def preflight(self, job: Job) -> dict[str, dict[str, str]]:
        return {"localhost": local_versions()}

    def request(self, job: Job, files: Path | None = None, name: str = "tfkv",
                environ: Mapping[str, str] | None = None) -> Request:
        return Request(commands(job.plan, str(job.workdir)))

    def launch(self, job: Job, out: IO[str]) -> Result:
        return run(job.plan, out=out, request=self.request(job))


def commands(plan: list[Process], cwd: str | None = None) -> list[Command]:
    """Each role as a process here: this machine's whole environment, less what the plan decides
    (plan.NOT_FORWARDED), so that the plan's variables and the forwarded ones are those an ssh
    role gets; unbuffered, so that its lines come as they are written."""
    return [Command(p.name, list(p.argv), {**p.env, "PYTHONUNBUFFERED": "1"}, tuple(sorted(NOT_FORWARDED)), cwd)
            for p in plan]


def _preexec() -> None:
    """In a role, before its command: SIGHUP, the teardown's signal (supervisor.STOP), ends it
    even under `nohup` (which a child inherits); SIGKILL when the launcher dies (kill -9, a crash:
    SIGTERM would be taken for a preemption, and the job it belonged to is over)."""
    signal.signal(supervisor.STOP, signal.SIG_DFL)
    die_with_parent(signal.SIGKILL)


def run(plan: list[Process], cwd: str | None = None, out: IO[str] | None = None,
        request: Request | None = None) -> Result:
    """Start every process of `plan` here (as `request` says: its commands, one per process in
    plan order; by default `commands(plan, cwd)`) and wait for the job to end (tfkv.launcher.supervisor)."""
    started = (request or Request(commands(plan, cwd))).commands
    out = out or sys.stdout
    lock = threading.Lock()
    children: dict[str, subprocess.Popen] = {}
    pumps: list[threading.Thread] = []
    warn_without_parent_death()

    def start() -> None:
        for p, c in zip(plan, started):
            child = subprocess.Popen(
                c.argv, cwd=c.cwd, env=c.environ(os.environ),
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, preexec_fn=_preexec)
            children[p.name] = child
            t = threading.Thread(target=_pump, args=(p.name, child.stdout, out, lock), daemon=True)
            t.start()
            pumps.append(t)

    def teardown() -> None:
        supervisor.stop_groups(list(children.values()))
        for t in pumps:
            t.join(timeout=5)

    def interrupt() -> list[str]:
        # Ctrl-C to worker 0, the one that writes checkpoints: it finishes the one in progress,
        # then the teardown ends the rest. Not to the others: a worker interrupted first reports
        # a failure, and the scheduler stops the servers under worker 0's checkpoint.
        reached = [p.name for p in plan if p.role == "worker" and p.rank == 0 and p.name in children]
        for name in reached:
            signal_group(children[name].pid, signal.SIGINT)
        return reached

    ends = supervisor.Ends([p.name for p in plan])
    failure = supervisor.supervise(ends, supervisor.poll(children, ends), teardown, start=start, interrupt=interrupt)
    return Result(supervisor.returncode(failure), failure)
