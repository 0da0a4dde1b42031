"""What a backend runs for a job, as data: its commands and the scripts it writes (torchx's
AppDryRunInfo, for tfkv's backends).

Each backend turns a job into a `Request` by a pure function (`Backend.request`: no process
started, no file written), then its `launch` writes the request's scripts and starts its commands
its own way. `tfkv-launch --dry-run` and `tfkv-run ... cluster.dry_run=true` print the request
(`Request.text`) instead, and the launcher contract suite holds each backend's request for a fixed
job against a golden file. The job's keys never appear: their variables are shown as `<secret>`.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from tfkv.keys import SECRET_NAMES

HIDDEN = "<secret>"


@dataclass
class Command:
    """One command of a job: a program started here, or a shell command run on a host over ssh."""

    name: str  # what it is, e.g. "scheduler", "qsub", "worker 1 @node2"
    argv: list[str]  # the program and its arguments (on a host: ["sh", "-c", the command its login shell runs])
    env: dict[str, str] = field(default_factory=dict)  # set over the launching shell's environment
    unset: tuple[str, ...] = ()  # the launching shell's variables it does not get
    cwd: str | None = None  # where it starts (here)
    host: str | None = None  # None: this machine; else the host it runs on, over ssh

    def environ(self, environ: Mapping[str, str]) -> dict[str, str]:
        """Its whole environment, started from `environ` (the launching shell's)."""
        return {**{k: v for k, v in environ.items() if k not in self.unset}, **self.env}

    def text(self) -> str:
        where = f"on {self.host}" if self.host else "here" + (f", in {self.cwd}" if self.cwd else "")
        lines = [f"# {self.name} ({where})"]
        lines += [f"#   {k}={shlex.quote(HIDDEN if k in SECRET_NAMES else v)}" for k, v in sorted(self.env.items())]
        if self.unset:
            lines.append(f"#   without {' '.join(sorted(self.unset))}")
        body = self.argv[2] if self.host and self.argv[:2] == ["sh", "-c"] else shlex.join(self.argv)
        return "\n".join(lines + [body])


@dataclass
class Request:
    """Every command a backend starts for a job, in order, and the scripts it writes before them
    (path -> text; under the directory given to `Backend.request`)."""

    commands: list[Command]
    scripts: dict[str, str] = field(default_factory=dict)

    def command(self, name: str) -> Command:
        """The command named `name` (a backend finds its own parts by name)."""
        return next(c for c in self.commands if c.name == name)

    def write(self) -> None:
        """Write the scripts (the directory exists: tfkv.launcher.backends.batch.job_files)."""
        for path, text in self.scripts.items():
            Path(path).write_text(text)

    def text(self) -> str:
        """What a dry run prints: each script, then each command."""
        parts = [f"# script {path}\n{text.rstrip()}" for path, text in self.scripts.items()]
        return "\n\n".join(parts + [c.text() for c in self.commands]) + "\n"
