"""`tfkv-emulate up|down`: an emulated cluster from the command line (needs root).

    tfkv-emulate up --hosts 4 --cpus 0.4 --link 1gbit --dir /tmp/cl   # hosts node1..node4, left running
    tfkv-emulate up --hosts 2 --cpus-each 0.4,0.2 --dir /tmp/cl --wait  # in the foreground until Ctrl-C
    tfkv-emulate down --dir /tmp/cl                                     # also after a crash

A request this machine cannot hold is one line and exit status 2, with nothing made.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from tfkv import versions
from tfkv.emulate.cluster import Cluster
from tfkv.emulate.spec import HostSpec, Refused


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tfkv-emulate", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # --version unwrapped
    parser.add_argument("--version", action="version", version=f"tfkv-emulate {versions()}",
                        help="print tfkv's version and those of what it runs on, and exit")
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="bring hosts node1..nodeN up")
    up.add_argument("--hosts", type=int, required=True, help="how many hosts (node1..nodeN)")
    up.add_argument("--cpus", type=float, help="every host's CPU budget in cores (default: unlimited)")
    up.add_argument("--cpus-each", help="each host's budget, comma-separated (a straggler: 0.4,0.4,0.4,0.2)")
    up.add_argument("--link", help="every host's link rate both ways, as tc writes it: 100mbit, 1gbit, 10gbit")
    up.add_argument("--link-in", help="the rate into each host (overrides --link)")
    up.add_argument("--link-out", help="the rate out of each host (overrides --link)")
    up.add_argument("--dir", type=Path, required=True, help="state directory: keys, ssh config, hosts file, record")
    up.add_argument("--wait", action="store_true", help="stay in the foreground; Ctrl-C or SIGTERM takes it down")
    down = commands.add_parser("down", help="take down the cluster recorded in --dir")
    down.add_argument("--dir", type=Path, required=True)
    return parser


def specs(args: argparse.Namespace) -> list[HostSpec]:
    """The HostSpecs the `up` arguments ask for; Refused on a --cpus-each that does not fit."""
    cpus: list[float | None] = [args.cpus] * max(args.hosts, 0)
    if args.cpus_each:
        try:
            cpus = [float(c) for c in args.cpus_each.split(",")]
        except ValueError:
            raise Refused(f"--cpus-each {args.cpus_each}: write one number of cores per host, e.g. 0.4,0.4,0.2") from None
        if len(cpus) != args.hosts:
            raise Refused(f"--cpus-each names {len(cpus)} budgets for {args.hosts} hosts: give one per host")
    return [HostSpec(f"node{i + 1}", cpus=c, link=args.link, link_in=args.link_in, link_out=args.link_out)
            for i, c in enumerate(cpus)]


def _up(args: argparse.Namespace) -> None:
    cluster = Cluster.up(specs(args), state_dir=args.dir)
    hostfile = cluster.write_hosts(cluster.state_dir / "hosts")
    for h in cluster.hosts:
        cpus = "unlimited" if h.cpus is None else f"{h.cpus:g}"
        print(f"{h.name} {h.address} cpus={cpus} in={h.link_in or 'unlimited'} out={h.link_out or 'unlimited'}")
    print(f"ssh config: {cluster.ssh_config}   (ssh -F {cluster.ssh_config} node1)")
    print(f"hosts file: {hostfile}")
    print(f"use: TFKV_SSH_CONFIG={cluster.ssh_config} tfkv-run kvstore=dist_sync cluster=ssh "
          f"cluster.hostfile={hostfile} ...")
    if not args.wait:
        print(f"down: tfkv-emulate down --dir {cluster.state_dir}")
        return
    print("up until Ctrl-C", flush=True)
    with cluster:  # SIGTERM and Ctrl-C both end the wait and take it down
        try:
            while True:
                signal.pause()
        except KeyboardInterrupt:
            pass
    print("down")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "up":
            _up(args)
        else:
            gone = Cluster.down_all(args.dir)
            print(f"down: {', '.join(gone)}" if gone else f"nothing left to take down in {args.dir}")
    except Refused as e:
        print(f"tfkv-emulate: {e}", file=sys.stderr)
        return 2
    except (RuntimeError, OSError) as e:  # a command that failed while making it (all made is taken down)
        print(f"tfkv-emulate: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
