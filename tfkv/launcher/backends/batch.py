"""What the batch backends (mpi, slurm, sge, yarn) share on the launcher's side: their client
(mpirun, srun, sbatch, qsub, yarn) started in its own process group that dies with the launcher,
stopped with whatever it left behind, supervised (tfkv.launcher.supervisor) until it ends or a
role fails; the merged output stream that prefixes nothing itself (the role helper already did)
but feeds each role's end to the supervisor; job
names and job files. The per-rank side is tfkv.launcher.role. No TensorFlow is imported here.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import IO, Any, Callable, Sequence

from tfkv.launcher import supervisor
from tfkv.launcher.process import die_with_parent, signal_group, warn_without_parent_death
from tfkv.launcher.role import EXIT_LINE


def start(argv: list[str], env: dict[str, str] | None = None, cwd: str | Path | None = None,
          stdin: int | None = subprocess.DEVNULL) -> subprocess.Popen:
    """A client (mpirun, srun, sbatch, qsub, ...) in its own process group that dies with us."""
    warn_without_parent_death()
    return subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=stdin,
                            start_new_session=True, preexec_fn=lambda: die_with_parent(signal.SIGTERM))


def _descendants(pid: int) -> list[tuple[int, str]]:
    """Every process below `pid`, as (pid, start time): the start time tells a reused pid apart."""
    children: dict[int, list[tuple[int, str]]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            children.setdefault(int(fields[1]), []).append((int(entry), fields[19]))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += [k for k, _ in kids]
    return found


def _kill_if_same(pid: int, started: str) -> None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[19] == started:
                os.kill(pid, signal.SIGKILL)
    except (OSError, IndexError):
        pass


def stop(proc: subprocess.Popen, grace: float = 5.0, first: int = signal.SIGTERM) -> None:
    """Signal the process group, give it `grace` seconds, then kill the group and whatever the
    client started in groups of their own (mpirun's ssh sessions); reap it."""
    tree = _descendants(proc.pid) if proc.poll() is None else []
    if proc.poll() is None:
        signal_group(proc.pid, first)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    signal_group(proc.pid, signal.SIGKILL)
    for pid, started in tree:
        _kill_if_same(pid, started)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def supervise(proc: subprocess.Popen, output: "Output", teardown: float,
              interrupt: Callable[[subprocess.Popen], None] | None = None,
              ends_itself: bool = True) -> str | None:
    """tfkv.launcher.supervisor for a resource manager's client (mpirun, srun): the job is over
    when the client ends; the grace after a failure has `teardown` more seconds when the client
    `ends_itself` a job one of whose roles failed. Then, if it still runs, `interrupt` it (its own
    way to end a job), stop it and what it started, and finish the output. The failure line."""
    def stop_client() -> None:
        if interrupt is not None and proc.poll() is None:
            interrupt(proc)
        stop(proc, grace=teardown)
        output.join()

    return supervisor.supervise(output.ends, lambda: proc.poll() is not None, stop_client,
                                extra=teardown if ends_itself else 0.0)


def scheduler_ends(scheduler: subprocess.Popen, after: str) -> str | None:
    """Every worker done: the scheduler (run here) ends on its own; a line if it does not."""
    try:
        scheduler.wait(timeout=30)
    except subprocess.TimeoutExpired:
        return f"the scheduler did not end after {after}"
    return None


def quietly(argv: list[str], env: dict[str, str] | None = None, timeout: float = 60) -> int | None:
    """Run a teardown command (scancel, qdel, yarn application -kill): its status, None if it
    could not run or hung; a teardown goes on either way."""
    try:
        return subprocess.run(argv, env=env, capture_output=True, timeout=timeout).returncode
    except (OSError, subprocess.SubprocessError):
        return None


class Output:
    """The job's merged output: lines go to `out` as they come; the helper's exit lines tell which
    role ended how, in the order they arrived. `names` are the plan's roles: those that never
    reported their end are the ones still running, blamed when every failure is a peer's reaction
    (a stopped role never reports; the resource manager kills it with the job)."""

    def __init__(self, out: IO[str], names: Sequence[str] = (), watch: str | None = None):
        self.out = out
        self.ends = supervisor.Ends(names)
        self.watch = re.compile(watch) if watch else None
        self.found: list[str] = []  # what `watch` (one group) matched, in order: job ids, app ids
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []
        self.last: dict[str, str] = {}  # the last line each client (by prefix) wrote: its error

    def line(self, text: str) -> None:
        with self.lock:
            self.out.write(text + "\n")
            self.out.flush()
            if self.watch:
                self.found += [m.group(1) for m in self.watch.finditer(text) if m.group(1) not in self.found]
            m = EXIT_LINE.match(text)
            if m:
                self.ends.ended(m["name"], int(m["code"]) if m["code"] is not None
                                else -signal.Signals[m["sig"]].value)

    def cause(self) -> str | None:
        return self.ends.cause()

    def pump(self, stream: IO[bytes], prefix: str = "") -> None:
        """Forward a pipe's lines (with `prefix` for a client's own messages) on a thread."""
        def run() -> None:
            for raw in iter(stream.readline, b""):
                text = raw.decode(errors="replace").rstrip("\n")
                if text.strip():
                    self.last[prefix] = text.strip()
                self.line(prefix + text)
            stream.close()

        self._thread(run)

    def tail(self, path: Path, stop: threading.Event, prefix: str = "") -> None:
        """Forward the lines a batch job writes to `path` (on a shared file system) until `stop`."""
        def run() -> None:
            f = None
            rest = b""
            while True:
                stopping = stop.is_set()  # read once more after stop: the job's last lines
                if f is None and path.exists():
                    f = open(path, "rb")
                if f is not None:
                    data = rest + f.read()
                    *lines, rest = data.split(b"\n")
                    for raw in lines:
                        self.line(prefix + raw.decode(errors="replace"))
                if stopping:
                    break
                stop.wait(0.1)
            if f is not None:
                if rest:
                    self.line(prefix + rest.decode(errors="replace"))
                f.close()

        self._thread(run)

    def _thread(self, target: Any) -> None:
        t = threading.Thread(target=target, daemon=True)
        t.start()
        self.threads.append(t)

    def join(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(timeout=max(0.1, deadline - time.monotonic()))


def job_name(kind: str) -> str:
    """A name no other job has: scancel/qdel/yarn find the job by it even before its id is known."""
    return f"tfkv-{kind}-{os.getpid()}-{os.urandom(3).hex()}"


def job_files(run_dir: Path | None, kind: str) -> Path:
    """Where a batch job's script and output files go: the run directory's launch/ (which the
    roles must see: a shared file system), else a fresh directory under /tmp."""
    if run_dir is not None:
        d = Path(run_dir) / "launch" / kind
        d.mkdir(parents=True, exist_ok=True)
        return d
    import tempfile

    return Path(tempfile.mkdtemp(prefix=f"tfkv-{kind}-"))

