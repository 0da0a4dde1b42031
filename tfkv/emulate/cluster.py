"""Cluster: bring N emulated hosts up, and take them down again, also after a crash.

What a cluster is made of is recorded in `<state_dir>/cluster.json` before it is made (its
names all follow from the subnet it claimed), so `Cluster.down_all(state_dir)` can tear it down
after the process that made it was killed. A teardown kills every process on the hosts (their
cgroups and network namespaces), deletes veths, namespaces, cgroups and the bridge, and removes
the record; a second teardown finds nothing. `with Cluster.up(...)` tears down on leaving,
also on an exception, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import json
import shutil
import signal
import threading
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Sequence

from tfkv.emulate import budget, net, sshd
from tfkv.emulate.host import Host
from tfkv.emulate.spec import HostSpec, Refused, check

RECORD = "cluster.json"


def _state_dir(path: Path) -> Path:
    """`path` made absolute; Refused (one line) where it, or the nearest part of it that exists,
    is not a directory (`--dir` naming a file), before anything is made or read."""
    path = Path(path).absolute()
    try:
        there = next((p for p in (path, *path.parents) if p.exists()), None)
    except PermissionError:  # not ours to look into: spec.check's refusal (root) comes first
        return path
    if there is not None and not there.is_dir():
        where = f"--dir {path}" if there == path else f"--dir {path}: {there}"
        raise Refused(f"{where} is a file, not a directory; name a directory for the cluster's state "
                      "(keys, ssh config, hosts file; `up` makes it where it does not exist)")
    return path


def _sigterm(signum, frame):
    raise SystemExit(128 + signum)


@contextmanager
def _signals(handler):
    """SIGTERM (and, with SIG_IGN, SIGINT) handled by `handler` within the block, in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signums = (signal.SIGTERM, signal.SIGINT) if handler is signal.SIG_IGN else (signal.SIGTERM,)
    before = {s: signal.signal(s, handler) for s in signums}
    try:
        yield
    finally:
        for s, h in before.items():
            signal.signal(s, h)


class Cluster:
    """Hosts made by `Cluster.up`; see tfkv/emulate/__init__.py for the whole interface."""

    def __init__(self, state_dir: Path, record: dict):
        self.state_dir = state_dir
        self.record = record
        etc_hosts = state_dir / "etc_hosts"
        self.hosts = [Host(h["name"], h["address"], h["cpus"], h["link_in"], h["link_out"], h["namespace"],
                           Path(h["cgroup"]) if h["cgroup"] else None, etc_hosts) for h in record["hosts"]]
        self.ssh_config = state_dir / "ssh_config"

    # -- up -------------------------------------------------------------------------------------

    @classmethod
    def up(cls, specs: list[HostSpec], state_dir: Path, client_key: Path | None = None,
           euid: int | None = None) -> Cluster:
        """Make the hosts; Refused (one line) before anything is made if this machine cannot.

        client_key: a private key (its .pub beside it) the sshds accept and the ssh config offers;
        by default one is generated in state_dir."""
        state_dir = _state_dir(state_dir)
        check(specs, euid=euid)
        if (state_dir / RECORD).exists():
            raise Refused(f"{state_dir} holds a cluster already: tear it down first (tfkv-emulate down --dir {state_dir})")
        made_dir = not state_dir.exists()
        state_dir.mkdir(parents=True, exist_ok=True)
        with _signals(_sigterm):
            token = f"tfkv-emulate-{uuid.uuid4().hex}"
            k = net.claim(token)
            cluster = cls(state_dir, cls._plan(specs, k, token, made_dir))
            cluster._save()
            try:
                cluster._make(specs, client_key)
            except BaseException:
                cluster.down()
                raise
        return cluster

    @staticmethod
    def _plan(specs: list[HostSpec], k: int, token: str, made_dir: bool) -> dict:
        prefix = f"tke{k}"
        return {"token": token, "k": k, "prefix": prefix, "made_dir": made_dir, "hosts": [
            {"name": s.name, "address": f"{net.subnet(k)}.{i + 2}", "cpus": s.cpus, "link_in": s.rate_in,
             "link_out": s.rate_out, "namespace": net.namespace_name(k, i),
             "cgroup": str(budget.path(prefix, s.name)) if s.cpus is not None else None}
            for i, s in enumerate(specs)]}

    def _save(self) -> None:
        tmp = self.state_dir / f"{RECORD}.tmp"
        tmp.write_text(json.dumps(self.record, indent=1))
        tmp.replace(self.state_dir / RECORD)

    def _make(self, specs: list[HostSpec], client_key: Path | None) -> None:
        k = self.record["k"]
        self.hosts[0].etc_hosts.write_text("127.0.0.1 localhost\n" + "".join(f"{h.address} {h.name}\n" for h in self.hosts))
        key = sshd.keys(self.state_dir, client_key)
        for i, host in enumerate(self.hosts):
            net.add_host(k, i, host.address)
            net.shape(k, i, host.link_in, host.link_out)
            if host.cgroup:
                budget.make(host.cgroup, host.cpus)
            sshd.config(self.state_dir, host)
        for host in self.hosts:
            sshd.start(self.state_dir, host)
        sshd.client_config(self.ssh_config, self.hosts, key)

    # -- use ------------------------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        """What makes tfkv's ssh launcher (and `ssh -F`) reach the hosts by name."""
        return {"TFKV_SSH_CONFIG": str(self.ssh_config)}

    def write_hosts(self, path: Path, slots: int = 1, hosts: Sequence[str] | None = None,
                    servers: Sequence[str] = ()) -> Path:
        """A tfkv/MPI hosts file naming every host (or those of `hosts`, in that order), `slots`
        worker slots each; those of `servers` are server hosts (`role=server`, no slots)."""
        names = list(hosts) if hosts is not None else [h.name for h in self.hosts]
        Path(path).write_text("".join(f"{n} role=server\n" if n in servers else f"{n} slots={slots}\n"
                                      for n in names))
        return Path(path)

    def host(self, name: str) -> Host:
        return next(h for h in self.hosts if h.name == name)

    def start_sshd(self, host: Host) -> None:
        """Start a host's sshd again (after a test killed everything on that host)."""
        sshd.start(self.state_dir, host)

    # -- down -----------------------------------------------------------------------------------

    def down(self) -> list[str]:
        """Tear everything down; what was there to tear down (empty the second time)."""
        return self.down_all(self.state_dir)

    @classmethod
    def down_all(cls, state_dir: Path) -> list[str]:
        """Tear down the cluster recorded in state_dir, whatever is left of it; what was torn down."""
        state_dir = _state_dir(state_dir)
        try:
            record = json.loads((state_dir / RECORD).read_text())
        except FileNotFoundError:
            return []
        cluster = cls(state_dir, record)
        with _signals(signal.SIG_IGN):  # a second Ctrl-C must not leave half a cluster
            gone = cluster._teardown() if net.owns(record["k"], record["token"]) else []
            if record["made_dir"]:
                shutil.rmtree(state_dir, ignore_errors=True)
            else:
                (state_dir / RECORD).unlink()
        return gone

    def _teardown(self) -> list[str]:
        killed = set()

        def alive() -> list[int]:
            pids = [pid for host in self.hosts for pid in host.pids()]
            killed.update(pids)
            return pids

        budget.kill(alive)
        gone = [f"{len(killed)} processes"] if killed else []
        for i, host in enumerate(self.hosts):
            gone += net.delete_host(self.record["k"], i)
            if host.cgroup:
                gone += budget.remove(host.cgroup)
        return gone + net.delete_bridge(self.record["k"])  # last: while it is there, the names are ours

    def __enter__(self) -> Cluster:
        self._term = _signals(_sigterm)
        self._term.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.down()
        finally:
            self._term.__exit__(None, None, None)

    def __repr__(self) -> str:
        return f"Cluster({self.record['prefix']}: {', '.join(f'{h.name}={h.address}' for h in self.hosts)})"
