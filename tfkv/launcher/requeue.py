"""A preempted run under Slurm puts its own batch job back in the queue (`scontrol requeue`).

`tfkv-run` that ends "preempted, resumable" (tfkv.errors.EXIT_PREEMPTED: worker 0 checkpointed at
a step's end after SIGUSR1, Slurm's `--signal=B:USR1@<seconds>`) inside a Slurm batch job
(SLURM_JOB_ID set: the batch script, or a step of it; the slurm launcher inside an allocation)
asks Slurm to requeue that job. The job keeps its id, so a run directory named after it
(`hydra.run.dir=outputs/slurm-${oc.env:SLURM_JOB_ID}`) is the same when it starts again, and
`resume=auto` continues from the checkpoint. Only a job Slurm may requeue is asked (a batch job,
`Requeue=1`: `sbatch --requeue`, or the cluster's JobRequeue=1 default); otherwise one line says
why not and the run exits 75 as before, for its owner to run again.

`python -m tfkv.launcher.requeue RUN_DIR` does the same from the slurm launcher's batch script
(tfkv.launcher.backends.slurm.batch_script), after its roles' step ended preempted; status 0 when the job
was requeued.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable, Mapping

from tfkv.launcher import record

TIMEOUT = 60.0  # seconds for scontrol (a busy slurmctld)


def job_fields(job_id: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """`scontrol show job -o <id>` as key -> value (Requeue, BatchFlag, Restarts, JobState, ...);
    empty when scontrol cannot tell."""
    try:
        out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True,
                             timeout=TIMEOUT, env=None if environ is None else dict(environ)).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    return dict(re.findall(r"(\w+)=(\S*)", out))


def requeue(run_dir: Path | None, say: Callable[[str], None], environ: Mapping[str, str] | None = None) -> bool:
    """Requeue this Slurm batch job, saying each step as a line (`say`) and recording the restart
    in the run directory's launch/restarts.json before Slurm ends this process; whether it was
    requeued. Nothing happens outside Slurm."""
    environ = os.environ if environ is None else environ
    job_id = environ.get("SLURM_JOB_ID")
    if not job_id:
        return False
    if not shutil.which("scontrol", path=environ.get("PATH")):
        say(f"not requeued: scontrol is not on PATH in Slurm job {job_id}; submit it again by hand")
        return False
    fields = job_fields(job_id, environ)
    if fields.get("BatchFlag") == "0":
        say(f"not requeued: Slurm job {job_id} is not a batch job (salloc or srun); "
            "submit it with sbatch --requeue to have it requeued")
        return False
    if fields.get("Requeue") == "0":
        say(f"not requeued: Slurm job {job_id} is not requeueable; submit it with sbatch --requeue "
            "(and --signal=B:USR1@120)")
        return False
    restart = int(fields.get("Restarts") or 0) + 1
    # Slurm ends this process once the job is requeued: the line and the record come first.
    say(f"requeueing Slurm job {job_id} (restart {restart}); it starts again with the same command, "
        "which resume=auto continues")
    if run_dir is not None:
        record.restart(run_dir, restart, f"preempted; requeued Slurm job {job_id}")
    try:
        done = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=TIMEOUT,
                              env=dict(environ))
    except (OSError, subprocess.SubprocessError) as e:
        say(f"requeue of Slurm job {job_id} failed ({e}); submit it again by hand")
        return False
    if done.returncode != 0:
        why = (done.stderr or done.stdout).strip().splitlines()
        say(f"requeue of Slurm job {job_id} failed ({why[-1] if why else f'status {done.returncode}'}); "
            "submit it again by hand")
        return False
    return True


def workers_resume(run_dir: Path) -> str:
    """The resume setting the workers of the job in `run_dir` start with (its config record,
    config_resolved.yaml); "auto" where there is none (a tfkv-launch job's own command)."""
    import yaml

    try:
        # the launcher's record of the workers' config (tfkv.worker.RECORD, which this layer does not import)
        return str(yaml.safe_load((Path(run_dir) / "config_resolved.yaml").read_text()).get("resume"))
    except (OSError, AttributeError, yaml.YAMLError):
        return "auto"


def main(run_dir: Path) -> int:
    """The batch script's requeue: only a job whose workers resume by themselves (resume=auto), as
    a requeued one must, to continue from the checkpoint and not start afresh over it."""
    def say(line: str) -> None:
        print(f"tfkv: {line}", flush=True)

    resume = workers_resume(run_dir)
    if resume != "auto":
        say(f"not requeued: the job's workers start with resume={resume}, so a requeued job would not "
            "continue from the checkpoint; run it with resume=auto to have it requeued")
        return 1
    return 0 if requeue(run_dir, say) else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
