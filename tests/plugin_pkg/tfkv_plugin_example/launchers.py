"""A launcher of its own: tfkv's local launcher that says it ran, with a setting of its own."""

from dataclasses import dataclass

from tfkv.config import RemoteCluster
from tfkv.config.cluster import setting
from tfkv.launcher.backends.local import LocalLauncher


@dataclass
class TwinCluster(RemoteCluster):
    """Its cluster.* settings: every launcher's, hostfile and python, and its own greeting
    (`cluster.greeting=...`, `tfkv-launch --greeting ...`)."""

    greeting: str = setting("starting the job", "what the twin launcher says as it starts the job")


class TwinLauncher(LocalLauncher):
    name = "twin"
    config = TwinCluster

    def launch(self, job, out):
        out.write(f"twin launcher: {self.settings.greeting}\n")
        return super().launch(job, out)
