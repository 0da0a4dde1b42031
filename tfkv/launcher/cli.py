"""`tfkv-launch`: MXNet's launch.py for tfkv. Starts a scheduler, servers and workers running any
command, through one of the launcher backends, and tears the whole job down when one fails."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import typing
from pathlib import Path
from typing import Any

from tfkv import versions
from tfkv.config import cluster
from tfkv.errors import TfkvError, report

EPILOG = """\
examples:
  tfkv-launch -n 2 --launcher local -- tfkv-run kvstore=dist_sync
  tfkv-launch -n 2 -s 2 -H hosts --launcher ssh --sync-dst-dir /tmp/job -- python3 train.py
  tfkv-launch -n 4 -H hosts --launcher mpi -- python3 train.py --kv-store dist_async
  tfkv-launch -n 2 --launcher slurm --dry-run -- python3 train.py   (print what it would run)

Placement, as MXNet's launch.py: the scheduler on the first host; servers, then workers, cycle
through the hosts file (5 hosts, -n 3: servers on hosts 1-3, workers on hosts 4, 5 and 1).
Hosts file lines: host, host:port or user@host[:port], then optionally slots=N; '#' starts a
comment. With slots= (or --workers-per-host N) workers fill the hosts' slots in order instead.
Every role gets DMLC_ROLE, DMLC_PS_ROOT_URI, DMLC_PS_ROOT_PORT, DMLC_NUM_SERVER and
DMLC_NUM_WORKER; every worker TFKV_LOCAL_RANK and TFKV_LOCAL_SIZE (its index among, and the
number of, the workers on its host, for one GPU each; not under sge and yarn, which give tasks
no host index); servers and the scheduler run `python3 -m
tfkv.ps.node` with CUDA_VISIBLE_DEVICES=-1, workers run the command. "{rank}" in the command
becomes the worker's index. The job's record (plan, hosts, tree hash, versions, merged log,
rerun.sh) goes to --run-dir, which every role gets as TFKV_RUN_DIR (tfkv-run workers write their
metrics, checkpoints and logs there). Hosts may be ssh aliases: the scheduler listens on the
address its host reports over ssh.

Every role, on every backend, also gets these variables of this shell: TFKV_*, DMLC_*, PS_*,
MXNET_*, OMP_NUM_THREADS, KMP_AFFINITY, LD_LIBRARY_PATH, PYTHONPATH, TF_CPP_MIN_LOG_LEVEL; never
those the plan sets (DMLC_ROLE, DMLC_PS_ROOT_*, DMLC_NUM_*, their TFKV_ twins, the job's keys).

Exit status: 0 when every role exited 0; 1 when one failed (named on the last line); 2 for a
mistake found before anything started; 130 after Ctrl-C and 143 after SIGTERM, once every role
of the job is stopped. SIGTERM to tfkv-launch is a preemption first: tfkv-run workers checkpoint
at their next step and end the job, and tfkv-launch exits 75 (resumable); a second SIGTERM, or
20 s without the job's end (a command that is not tfkv-run), stops it now (143).
"""


# tfkv-launch's own defaults, where they differ from a config's (MXNet's launch.py: -n always
# given, as many servers as workers, ssh); names, types, defaults and help otherwise come from
# the launchers' settings schemas (the `config` each backend declares, tfkv's and a plug-in's:
# tfkv.launcher.job.schemas), the one definition.
LAUNCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "num_workers": {"required": True, "default": None},
    "num_servers": {"default": None, "help_more": " (default: -n)"},
    "launcher": {"default": "ssh", "help_more": " (default: ssh)"},
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tfkv-launch", description=__doc__.split("\n\n")[0].split(": ", 1)[1],
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    from tfkv.launcher import job
    from tfkv.launcher.base import REGISTRY  # tfkv's launchers and installed packages' (tfkv.plugins)

    schemas = job.schemas()
    types: dict[str, Any] = {}
    for schema in schemas:
        types.update(typing.get_type_hints(schema))
    for f in cluster.options(*schemas, first=("num_workers", "num_servers", "hostfile", "launcher", "sync_dst_dir")):
        own = dict(LAUNCH_DEFAULTS.get(f.name, {}))
        flags = [f.metadata["short"]] if f.metadata.get("short") else []
        kind = next((t for t in typing.get_args(types[f.name]) if t is not type(None)), types[f.name])
        extra: dict[str, Any] = {"action": argparse.BooleanOptionalAction} if kind is bool else {"type": kind}
        if typing.get_origin(kind) is list:  # --spare-hosts node3 node4 (before the command's --)
            extra = {"nargs": "+", "type": typing.get_args(kind)[0]}
        if f.name == "launcher":
            extra["choices"] = REGISTRY.names()
        p.add_argument(*flags, "--" + f.name.replace("_", "-"), default=own.get("default", f.default),
                       required=own.get("required", False), help=f.metadata.get("help", "") + own.get("help_more", ""),
                       **extra)
    p.add_argument("--version", action="version", version=f"tfkv-launch {versions()}",
                   help="print tfkv's version and those of what it runs on, and exit")
    p.add_argument("--run-dir", help="where the job's record goes (default: outputs/launch-<time>)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the workers' command, after --")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser().error("give the workers' command after --, e.g. -- python3 train.py")
    from tfkv import preempt
    from tfkv.errors import EXIT_PREEMPTED
    from tfkv.launcher import job

    run_dir = Path(args.run_dir or f"outputs/launch-{time.strftime('%Y-%m-%d_%H-%M-%S')}")
    if not args.dry_run:  # a dry run writes nothing
        run_dir.mkdir(parents=True, exist_ok=True)
    opts = job.Options(**{f.name: getattr(args, f.name) for f in dataclasses.fields(job.Options)})
    opts.num_servers = args.num_servers or args.num_workers
    try:
        result = job.launch(opts, command, Path.cwd(), run_dir.resolve(), ["tfkv-launch", *(argv or sys.argv[1:])],
                            sys.stdout)
    except TfkvError as e:
        report("tfkv-launch", e)  # its line and its class's exit status
    except KeyboardInterrupt:  # during the checks: once the job starts, the launch takes it
        print("tfkv-launch: interrupted before the job started; nothing was left running", file=sys.stderr)
        sys.exit(130)
    preempted = preempt.done(run_dir)
    if preempted and result.returncode <= 128:  # worker 0 (tfkv-run) checkpointed and stopped; the rest with it
        print(f"tfkv-launch: {preempted}", file=sys.stderr)
        sys.exit(EXIT_PREEMPTED)
    if result.failure:
        print(f"tfkv-launch: the job failed: {result.told()}; record in {run_dir}", file=sys.stderr)
        sys.exit(result.returncode if result.returncode > 128 else 1)  # 130 Ctrl-C, 143 SIGTERM


if __name__ == "__main__":
    main()
