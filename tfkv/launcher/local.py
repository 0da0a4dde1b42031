"""Run a plan as processes on this machine: merged, prefixed output; no process outlives the job.

Every role runs in its own session (process group) and is killed with the launcher if the
launcher dies (PR_SET_PDEATHSIG). When one role fails, the others get a moment to report the
failure themselves, then every group still running is terminated, then killed. Ctrl-C does the
same at once. The result names what failed first.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import IO

from tfkv.launcher import signals
from tfkv.launcher.base import Job, Result
from tfkv.launcher.plan import NOT_FORWARDED, Process
from tfkv.launcher.process import die_with_parent, done_waiting, first_cause, signal_group, warn_without_parent_death
from tfkv.launcher.record import local_versions

def _pump(name: str, stream: IO[bytes], out: IO[str], lock: threading.Lock) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        with lock:
            out.write(f"[{name}] {line}\n")
            out.flush()
    stream.close()


class LocalLauncher:
    """Every role as a process on this machine (MXNet's `--launcher local`)."""

    name = "local"

    def preflight(self, job: Job) -> dict[str, dict[str, str]]:
        return {"localhost": local_versions()}

    def launch(self, job: Job, out: IO[str]) -> Result:
        return run(job.plan, cwd=str(job.workdir), out=out)


def run(plan: list[Process], cwd: str | None = None, out: IO[str] | None = None) -> Result:
    """Start every process of `plan` here and wait for the job to end."""
    out = out or sys.stdout
    lock = threading.Lock()
    children: dict[str, subprocess.Popen] = {}
    pumps = []
    failure: str | None = None
    warn_without_parent_death()
    try:
        for p in plan:
            # This machine's whole environment, less what the plan decides (plan.NOT_FORWARDED), so
            # that the plan's variables and the forwarded ones are those an ssh role gets.
            env = {k: v for k, v in os.environ.items() if k not in NOT_FORWARDED}
            child = subprocess.Popen(
                p.argv, cwd=cwd, env={**env, **p.env, "PYTHONUNBUFFERED": "1"},
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, preexec_fn=lambda: die_with_parent(signal.SIGTERM))
            children[p.name] = child
            t = threading.Thread(target=_pump, args=(p.name, child.stdout, out, lock), daemon=True)
            t.start()
            pumps.append(t)
        failed: list[tuple[str, int]] = []  # in the order they were seen
        failed_at = None
        while True:
            # Every child polled (not any(), which stops at the first one running): polling is
            # what reaps a child and sets its returncode.
            running = [c.poll() is None for c in children.values()]
            for name, c in children.items():
                if c.returncode not in (None, 0) and all(name != f[0] for f in failed):
                    failed.append((name, c.returncode))
                    failed_at = failed_at or time.monotonic()
            if not any(running) or done_waiting(failed, failed_at, time.monotonic()):
                break
            time.sleep(0.05)
        running = [name for name, c in children.items() if c.poll() is None]
        for name, c in children.items():
            if c.returncode not in (None, 0) and all(name != f[0] for f in failed):
                failed.append((name, c.returncode))
        failure = first_cause(failed, running)
    except KeyboardInterrupt as e:
        failure = signals.failure(e)
    finally:
        with signals.shielded():
            _stop(list(children.values()))
            for t in pumps:
                t.join(timeout=5)
    return Result(0 if failure is None else 1, failure)


def _stop(children: list[subprocess.Popen]) -> None:
    """Terminate, then kill, every process group still running; reap them all."""
    alive = [c for c in children if c.poll() is None]
    for c in alive:
        signal_group(c.pid, signal.SIGTERM)
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and any(c.poll() is None for c in alive):
        time.sleep(0.05)
    for c in children:
        signal_group(c.pid, signal.SIGKILL)  # also whatever a role left behind in its group
        try:
            c.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
