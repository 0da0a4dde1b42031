"""A run directory belongs to one job at a time: `tfkv-run` holds an exclusive lock on its
`.tfkv.lock` for as long as the job runs, and a second job started on the same directory (a
requeue that overlaps the job it replaces, a command run twice) is refused in one line naming the
holder, before it reads a checkpoint or writes a file of its own.

The lock is the operating system's (fcntl.lockf, a POSIX record lock), not the file's existence:
it ends with the process that holds it, a kill -9 and a crash included, so a requeue after the
first job is gone always gets it; nothing stale is left to clean up. Across hosts it holds where
the file system passes POSIX locks to its server: NFSv4, NFSv3 with lockd (Linux sends flock and
fcntl locks there alike), Lustre mounted with `flock`, GPFS, BeeGFS. A file system that keeps locks
per client only (a Lustre mount with `localflock`, some FUSE file systems) stops a second job on
the same host only. The holder's pid, host and start time are written into the file for the
refusal's line; they are a description, the lock is what decides.

`tfkv-run` takes the lock before Hydra writes anything into the directory (tfkv.rundir, a Hydra
callback), so that a refused second job leaves every file of the running one as it was; the
job's own `hold` inside it then finds the lock already this process's. A POSIX lock belongs to
the process, and closing any descriptor of the file ends it: so the file is opened once per
process, and a nested `hold` of the same directory takes nothing and gives nothing back.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Iterator

from tfkv.errors import ConfigError

NAME = ".tfkv.lock"

_held: set[str] = set()  # the lock files this process holds, by real path


def _holder(path: Path) -> str:
    """The holder as its file describes it: `pid 123 on node1 since 2026-11-27 15:02:11`."""
    try:
        who = json.loads(path.read_text())
        return f"pid {who['pid']} on {who['host']} since {who['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process (it has not written its name yet)"


@contextlib.contextmanager
def hold(run_dir: Path) -> Iterator[None]:
    """Hold `run_dir`'s lock while the block runs; a ConfigError when another job holds it."""
    path = Path(run_dir) / NAME
    key = os.path.realpath(path)
    if key in _held:  # the caller's own, taken further out (before Hydra wrote the directory)
        yield
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EAGAIN):
                raise
            raise ConfigError(f"the run directory {run_dir} is in use by another tfkv-run job ({_holder(path)}); "
                              "wait for it to end (or stop it), or choose another hydra.run.dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "since": time.strftime("%Y-%m-%d %H:%M:%S")}).encode())
        _held.add(key)
        try:
            yield
        finally:
            _held.discard(key)
    finally:
        os.close(fd)  # closing ends the lock (and so does this process's end, however it ends)
