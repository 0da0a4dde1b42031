"""The hosts' network: a bridge of the cluster's own, a veth pair and a network namespace per host,
and tc's token bucket (tbf) on each end for the link rate in each direction.

A cluster claims a free subnet 10.(201 + k // 256).(k % 256).0/24 and the names that go with k
(bridge `tke<k>br`, namespaces `tke<k>h<i>`, veths `tke<k>v<i>`: at most 10 characters, under
Linux's 15) by making its bridge under a machine-wide lock, so runs beside each other (tests under
xdist, a benchmark) never pick the same. The bridge's alias carries the cluster's token, so a
teardown after a crash deletes only what its own cluster made.

Only the rate can be set: netem is not in this kernel, so no latency or loss is added; a packet
between two hosts crosses two veths and a bridge (tens of microseconds).
"""

from __future__ import annotations

import fcntl
import subprocess
from contextlib import contextmanager
from pathlib import Path

from tfkv.emulate.spec import rate_bits

LOCK = Path("/run/tfkv-emulate.lock")
SUBNETS = 9 * 256  # 10.201.0.0/24 .. 10.209.255.0/24
TBF_LATENCY = "10ms"  # how long a packet may wait in the bucket's queue before it is dropped


class NetError(RuntimeError):
    """An `ip` or `tc` command failed; the message is the command and what it said."""


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    if check and r.returncode != 0:
        raise NetError(f"{' '.join(argv)}: {r.stderr.strip()}")
    return r


def subnet(k: int) -> str:
    """The first three octets of subnet k: '10.201.5'."""
    return f"10.{201 + k // 256}.{k % 256}"


def bridge_name(k: int) -> str:
    return f"tke{k}br"


def namespace_name(k: int, i: int) -> str:
    return f"tke{k}h{i}"


def veth_name(k: int, i: int) -> str:
    return f"tke{k}v{i}"


@contextmanager
def _locked():
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    with open(LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def links() -> set[str]:
    return {line.split(":")[1].strip().split("@")[0] for line in sh("ip", "-o", "link", "show").stdout.splitlines()}


def namespaces() -> set[str]:
    return {line.split()[0] for line in sh("ip", "netns", "list").stdout.splitlines() if line.strip()}


def claim(token: str) -> int:
    """Make the bridge of the first free subnet, its alias `token`, and return its k."""
    with _locked():
        used_addresses = sh("ip", "-o", "-4", "addr", "show").stdout
        taken = links() | namespaces()
        for k in range(SUBNETS):
            mine = (bridge_name(k), f"tke{k}h", f"tke{k}v")  # a letter follows k: tke1h is not tke12h
            if f" {subnet(k)}." in used_addresses or any(n.startswith(mine) for n in taken):
                continue
            bridge = bridge_name(k)
            sh("ip", "link", "add", bridge, "type", "bridge")
            sh("ip", "link", "set", bridge, "alias", token)
            sh("ip", "addr", "add", f"{subnet(k)}.1/24", "dev", bridge)
            sh("ip", "link", "set", bridge, "up")
            return k
    raise NetError("no free subnet among 10.201.0.0/24 .. 10.209.255.0/24: delete leftover bridges tke*br")


def owns(k: int, token: str) -> bool:
    """Whether bridge k is there and was made by the cluster with this token."""
    r = sh("ip", "link", "show", bridge_name(k), check=False)
    return r.returncode == 0 and f"alias {token}" in r.stdout


def add_host(k: int, i: int, address: str) -> None:
    """Namespace i with eth0 at `address`, its peer on the bridge."""
    ns, veth = namespace_name(k, i), veth_name(k, i)
    sh("ip", "netns", "add", ns)
    sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
    sh("ip", "link", "set", veth, "master", bridge_name(k), "up")
    sh("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
    sh("ip", "-n", ns, "link", "set", "eth0", "up")
    sh("ip", "-n", ns, "link", "set", "lo", "up")


def _tbf(rate: str) -> list[str]:
    # The bucket must hold what arrives between two timer ticks, or the rate falls short of the
    # one asked for: 4 ms of traffic covers a 250 Hz kernel tick; the 64 KiB floor lets a whole
    # GSO segment (veths hand over up to 64 KiB at once) through a slow link.
    burst = max(int(rate_bits(rate) / 8 / 250), 64 * 1024)
    return ["tbf", "rate", rate, "burst", str(burst), "latency", TBF_LATENCY]


def shape(k: int, i: int, rate_in: str | None, rate_out: str | None) -> None:
    """Limit host i's link: what leaves the bridge-side veth goes into the host, what leaves its
    eth0 goes out of it (tc shapes what a device sends)."""
    if rate_in:
        sh("tc", "qdisc", "add", "dev", veth_name(k, i), "root", *_tbf(rate_in))
    if rate_out:
        sh("tc", "-n", namespace_name(k, i), "qdisc", "add", "dev", "eth0", "root", *_tbf(rate_out))


def namespace_pids(ns: str) -> list[int]:
    """Every process in that network namespace: all that runs on that host."""
    r = sh("ip", "netns", "pids", ns, check=False)
    return [int(p) for p in r.stdout.split()] if r.returncode == 0 else []


def delete_host(k: int, i: int) -> list[str]:
    """Delete host i's veth (both ends go at once) and namespace; what was there to delete."""
    gone = []
    if sh("ip", "link", "del", veth_name(k, i), check=False).returncode == 0:
        gone.append(f"veth {veth_name(k, i)}")
    if sh("ip", "netns", "del", namespace_name(k, i), check=False).returncode == 0:
        gone.append(f"netns {namespace_name(k, i)}")
    return gone


def delete_bridge(k: int) -> list[str]:
    return [f"bridge {bridge_name(k)}"] if sh("ip", "link", "del", bridge_name(k), check=False).returncode == 0 else []
