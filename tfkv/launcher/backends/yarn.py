"""`--launcher yarn`: servers and workers as YARN containers of Hadoop's distributed shell.

As dmlc-core's YARN tracker does, the scheduler runs on the submitting machine (through the role
helper, in its own process group), so its address is known before anything is submitted: the
plan's DMLC_PS_ROOT_URI, which must be an address the cluster's nodes reach (a hosts file whose
first line is this machine, or cluster.host=...). The servers and workers are distributed-shell
applications, one per group of processes that run the same command:

    yarn jar $HADOOP_HOME/share/hadoop/yarn/hadoop-yarn-applications-distributedshell-*.jar \\
        -jar <the same jar> -appname tfkv-...-servers -num_containers S \\
        -container_memory 2048 -container_vcores 1 -timeout 2147483647 \\
        -shell_command 'python3 -m tfkv.ps.node' -shell_env DMLC_ROLE=server -shell_env ...

Every container of an application runs the same command and the distributed shell gives them no
index, so a group shares one command; workers whose commands differ ("{rank}" in the command)
get one application each, with TFKV_RANK_HINT. The scheduler numbers the rest as they register.
`submissions()` returns these command lines; `launch` runs them, one client each (the client
waits for its application), and follows the clients' logs; the roles' own output stays in YARN's
container logs (`yarn logs -applicationId ...`).

Teardown: the scheduler tells every role when one fails and they exit; on Ctrl-C or a failure the
launcher kills every application it saw submitted (`yarn application -kill <id>`), then the
clients' and the scheduler's process groups. YARN's NodeManagers kill a container's processes.

Hadoop is not packaged for Debian, so this backend is checked by the exact command it builds.
"""

from __future__ import annotations

import glob
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Mapping, Optional

from tfkv.config.cluster import RemoteCluster, knob
from tfkv.errors import ConfigError
from tfkv.launcher import role, supervisor
from tfkv.launcher.backends import batch
from tfkv.launcher.base import Backend, Job, Program, Result
from tfkv.launcher.plan import Process, forwarded_env
from tfkv.launcher.record import local_versions
from tfkv.launcher.request import Command, Request

JAR_GLOB = "share/hadoop/yarn/hadoop-yarn-applications-distributedshell-*.jar"
TIMEOUT_MS = 2**31 - 1  # the client kills its application after -timeout ms (default 10 min)
# YARN runs a container's command as `bash -c "<command>"`: these would be expanded or end the string.
_UNSAFE = re.compile(r'["$`\\]')
_APP_ID = re.compile(r"\b(application_\d+_\d+)\b")  # what the client logs once it submitted



def find_jar(environ: Mapping[str, str] | None = None) -> str:
    """The distributed shell's jar under $HADOOP_HOME (or HADOOP_YARN_HOME)."""
    e = os.environ if environ is None else environ
    for home in (e.get("HADOOP_YARN_HOME"), e.get("HADOOP_HOME")):
        if home:
            jars = sorted(glob.glob(str(Path(home) / JAR_GLOB)))
            if jars:
                return jars[-1]
    raise ConfigError(f"no {Path(JAR_GLOB).name} under $HADOOP_HOME; set HADOOP_HOME to your Hadoop installation")


def _groups(plan: list[Process]) -> list[tuple[str, list[Process]]]:
    """Servers and workers grouped by the command they run: (label, processes)."""
    groups: dict[tuple, list[Process]] = {}
    for p in plan[1:]:
        groups.setdefault((p.role, tuple(p.argv)), []).append(p)
    labelled = []
    for (kind, _), procs in groups.items():
        if len(procs) == 1:
            label = procs[0].name.split(" @")[0].replace(" ", "")
        else:
            label = f"{kind}s" if sum(k == kind for k, _ in groups) == 1 else f"{kind}s{procs[0].rank}"
        labelled.append((label, procs))
    return labelled


def submissions(job: Job, jar: str, name: str = "tfkv", settings: YarnCluster | None = None,
                environ: Mapping[str, str] | None = None) -> list[tuple[str, list[str]]]:
    """The `yarn jar ...` command lines that submit the servers and the workers: (label, argv);
    containers' memory, cores and queue from `settings` (cluster.yarn_*)."""
    res = settings or YarnCluster()
    forwarded = forwarded_env(os.environ if environ is None else environ)
    subs = []
    for label, procs in _groups(job.plan):
        env = {**forwarded, **role.common_env(procs)}
        if len(procs) == 1:
            env = {**forwarded, **procs[0].env}
        command = shlex.join(procs[0].argv)
        bad = [f"{k}={v}" for k, v in env.items() if _UNSAFE.search(v) or any(c.isspace() for c in v)]
        if _UNSAFE.search(command) or bad:
            raise ConfigError(f"YARN runs the command as bash -c \"...\": {'; '.join(bad) or command!r} must not "
                              "contain spaces in variables, or \", $, ` or \\ anywhere")
        memory = res.yarn_server_memory_mb if procs[0].role == "server" else res.yarn_memory_mb
        argv = ["yarn", "jar", jar, "-jar", jar, "-appname", f"{name}-{label}",
                "-num_containers", str(len(procs)), "-container_memory", str(memory),
                "-container_vcores", str(res.yarn_vcores), "-timeout", str(TIMEOUT_MS)]
        if res.yarn_queue:
            argv += ["-queue", res.yarn_queue]
        argv += ["-shell_command", command]
        for k, v in sorted(env.items()):
            argv += ["-shell_env", f"{k}={v}"]
        subs.append((label, argv))
    return subs



@dataclass
class YarnCluster(RemoteCluster):
    """cluster=yarn's settings: those of launchers that reach other hosts, and the containers' resources."""

    yarn_memory_mb: int = knob("cluster.yarn_memory_mb")
    yarn_server_memory_mb: int = knob("cluster.yarn_server_memory_mb")
    yarn_vcores: int = knob("cluster.yarn_vcores")
    yarn_queue: Optional[str] = knob("cluster.yarn_queue")


class YarnLauncher(Backend):
    """The scheduler here; servers and workers as YARN distributed-shell containers."""

    name = "yarn"
    config = YarnCluster
    chooses_nodes = True
    local_ranks = False  # the distributed shell gives a container no index on its host
    programs = (Program("yarn", "install Hadoop (not packaged for Debian) and put $HADOOP_HOME/bin on PATH"),)

    def preflight(self, job: Job) -> dict[str, dict[str, str]]:
        self.need()
        submissions(job, find_jar(), settings=self.settings)  # the commands can be built
        return {"localhost": local_versions()}

    def request(self, job: Job, files: Path | None = None, name: str = "tfkv",
                environ: Mapping[str, str] | None = None) -> Request:
        """The scheduler here, then one distributed-shell client per group (`submissions`); the
        jar found under $HADOOP_HOME, else named by its pattern (a dry run without Hadoop)."""
        try:
            jar = find_jar(environ)
        except ConfigError:
            jar = f"$HADOOP_HOME/{JAR_GLOB}"
        env, cwd = {"PYTHONUNBUFFERED": "1"}, str(job.workdir)
        return Request([Command("scheduler", role.helper_argv(sys.executable, job.plan[:1], index=0), env, cwd=cwd)]
                       + [Command(f"yarn {label}", argv, env, cwd=cwd)
                          for label, argv in submissions(job, jar, name, self.settings, environ)])

    def launch(self, job: Job, out: IO[str]) -> Result:
        self.need()
        find_jar()  # refused here, not named by its pattern
        request = self.request(job, name=batch.job_name("yarn"))
        subs = [(c.name.split(" ", 1)[1], c.argv) for c in request.commands[1:]]
        output = batch.Output(out, [p.name for p in job.plan], watch=_APP_ID.pattern)
        env = request.command("scheduler").environ(os.environ)
        scheduler = batch.start(request.command("scheduler").argv, env=env, cwd=str(job.workdir))
        output.pump(scheduler.stdout)
        output.pump(scheduler.stderr, "[scheduler] ")
        clients: dict[str, subprocess.Popen] = {}

        def failed_clients() -> list[tuple[str, int]]:
            return [(f"yarn application {label}", c.returncode) for label, c in clients.items()
                    if c.returncode not in (None, 0)]

        def start() -> None:
            for label, argv in subs:
                clients[label] = batch.start(argv, env=env, cwd=str(job.workdir))
                output.pump(clients[label].stdout, f"[yarn {label}] ")
                output.pump(clients[label].stderr, f"[yarn {label}] ")

        def over() -> bool:
            # Every client polled each time (a list, not any()): polling sets a failed one's returncode.
            return not (any([c.poll() is None for c in clients.values()]) and not output.ends.failed
                        and not failed_clients() and scheduler.poll() in (None, 0))

        def scheduler_ends() -> str | None:
            if not output.ends.failed and not failed_clients():
                return batch.scheduler_ends(scheduler, "every YARN application finished")
            return None

        def teardown() -> None:
            if any(c.poll() is None for c in clients.values()):
                for app in output.found:  # the clients alone would leave them running
                    batch.quietly(["yarn", "application", "-kill", app], env, timeout=120)
            for c in clients.values():
                batch.stop(c)
            batch.stop(scheduler)
            output.join()

        # No grace after a failure here (extra=inf): a failed role or client ends the wait at once.
        failure = supervisor.supervise(output.ends, over, teardown, start=start, then=scheduler_ends,
                                       extra=float("inf"), interval=0.2)
        failure = failure or supervisor.first_cause(failed_clients())
        return Result(supervisor.returncode(failure), failure)

