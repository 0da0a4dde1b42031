"""A launcher of its own: tfkv's local launcher that says it ran."""

from tfkv.config import RemoteCluster
from tfkv.launcher.local import LocalLauncher


class TwinLauncher(LocalLauncher):
    name = "twin"
    config = RemoteCluster  # its cluster.* settings: every launcher's, and hostfile and python

    def launch(self, job, out):
        out.write("twin launcher: starting the job\n")
        return super().launch(job, out)
