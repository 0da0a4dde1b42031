"""An emulated cluster on this machine: hosts with their own hostname, address, sshd, CPU budget
and link rate in each direction, made of network namespaces, veths on a bridge, tc tbf and cgroup
v1 CPU quotas. Needs root. Latency cannot be emulated (netem is not in this kernel).

    from tfkv.emulate import Cluster, HostSpec, Refused

    with Cluster.up([HostSpec("node1", cpus=0.4, link="1gbit"),
                     HostSpec("node2", cpus=0.2, link_in="10gbit", link_out="1gbit")], state_dir=d) as cluster:
        cluster.write_hosts(d / "hosts")        # "node1 slots=1\\nnode2 slots=1\\n"
        env = cluster.env()                     # TFKV_SSH_CONFIG: tfkv's cluster=ssh reaches the hosts
        cluster.hosts[0].run(["hostname"])      # a process on node1: its namespaces and its cgroup

`Cluster.up` raises Refused (one line) before making anything this machine cannot hold;
`cluster.down()` / `Cluster.down_all(d)` / `tfkv-emulate down --dir d` take it all down.
Standard library only: no TensorFlow, no tfkv runtime.
"""

from tfkv.emulate.cluster import Cluster
from tfkv.emulate.host import Host
from tfkv.emulate.spec import HostSpec, Refused

__all__ = ["Cluster", "Host", "HostSpec", "Refused"]
